"""The order a trainer takes its shard's rows in: a pure function of (seed, trainer, step).

Shared by the live job's trainers and the training simulator
(`coordinator.simulator.training`), so both train on the very same batches.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


def steps_per_epoch(rows: int, batch_size: int) -> int:
    return math.ceil(rows / batch_size)


@lru_cache(maxsize=2)
def _epoch_order(seed: int, trainer: int, rows: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + trainer * 7_919 + epoch)
    return torch.randperm(rows, generator=generator)


def batch_rows(seed: int, trainer: int, rows: int, batch_size: int, step: int) -> torch.Tensor:
    """Which rows of its shard `trainer` trains on at `step` (0-based): a fresh seeded
    shuffle each epoch, cut into batches. A pure function of the step, so a resumed
    trainer takes up the data order exactly where the checkpoint left it."""
    epoch, position = divmod(step, steps_per_epoch(rows, batch_size))
    order = _epoch_order(seed, trainer, rows, epoch)
    return order[position * batch_size : (position + 1) * batch_size]
