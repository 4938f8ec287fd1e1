"""The synthetic data set (`synthetic:ROWSxFEATURES[:SEED]`): generated, never read.

Generated in blocks of `SYNTHETIC_BLOCK` rows, each from its own generators seeded from
(seed, block), so a member generates only the blocks it overlaps and the data
are the same whatever `world_size`. Features are float32 standard normal. The label is 1
where x0*x1 + x2*|x3| + 0.5*noise > 0 (feature indices modulo FEATURES): an interaction
trees must find by splitting twice. With at least 4 features the score's distribution is
symmetric about 0 (flip the signs of x0, x2 and the noise), so classes are balanced. Only
float32 multiplication, addition and abs are used: exactly rounded, hence identical on every
CPU, unlike vectorised sin/exp.
"""

from __future__ import annotations

import numpy as np

from coordinator.datasets.source import DataSource

#: Rows per synthetic block: the unit of generation, independent of world_size.
SYNTHETIC_BLOCK = 1 << 16


def synthetic_rows(source: DataSource, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows `start`..`stop`, generating only the blocks they overlap."""
    Xs, ys = [], []
    for block in range(start // SYNTHETIC_BLOCK, (stop - 1) // SYNTHETIC_BLOCK + 1):
        X, y = _synthetic_block(source, block)
        base = block * SYNTHETIC_BLOCK
        low, high = max(start, base) - base, min(stop, base + SYNTHETIC_BLOCK) - base
        Xs.append(X[low:high])
        ys.append(y[low:high])
    return np.concatenate(Xs), np.concatenate(ys)


def _synthetic_block(source: DataSource, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Block `block` of the data set; it depends on (seed, features, block) only, and on rows
    only through the length of the last block, so any prefix of rows is the same too."""
    n = min(SYNTHETIC_BLOCK, source.rows - block * SYNTHETIC_BLOCK)
    X = np.random.default_rng([source.seed, block, 0]).standard_normal(
        (n, source.features), dtype=np.float32
    )
    noise = np.random.default_rng([source.seed, block, 1]).standard_normal(n, dtype=np.float32)
    f = source.features
    score = X[:, 0] * X[:, 1 % f] + X[:, 2 % f] * np.abs(X[:, 3 % f]) + np.float32(0.5) * noise
    return X, (score > 0).astype(np.float32)
