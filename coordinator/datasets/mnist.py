"""MNIST-format images for a parameter-server job: IDX files from a directory, or the builtin
`digits` sample, with each trainer reading only its own contiguous shard of the training set.

`parse_mnist` runs before a job's members join, so it only reads headers: the four files'
magic numbers and sizes, that images and labels agree in count and that train and test images
agree in shape, and (uncompressed files) that each file's size is what its header promises.
The size of a .gz file is not known without decompressing it all, so a short or overlong .gz is
found when its rows are loaded; only the rows a member reads are checked (plus, for the member
holding the last rows, that nothing follows them).

A directory is searched as given, then as a torchvision root (`MNIST/raw`, `FashionMNIST/raw`),
then `raw/`: the first of these holding any standard file name must hold all four. If a file is
there both uncompressed and as .gz, the uncompressed one is read (it can be seeked and sized).
The files' format is in `idx`; the builtin sample in `digits` (a directory named `digits`
can be given as `./digits`).

Pixels are scaled to [0, 1] and normalised with the usual MNIST mean and std, so models see
standard MNIST input. `Images.digest` is SHA-256 over the raw uint8 image bytes (C order) then
the uint8 label bytes of the rows held, so members and a whole-split load can be compared.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator.datasets import digits, idx
from coordinator.datasets.digits import DIGITS
from coordinator.datasets.idx import IMAGES_MAGIC, LABELS_MAGIC, BadDataFile
from coordinator.datasets.load import EmptyShard
from coordinator.datasets.shards import plan

#: Mean and std of MNIST training pixels in [0, 1], as models conventionally expect.
MEAN = 0.1307
STD = 0.3081

TRAIN_IMAGES = "train-images-idx3-ubyte"
TRAIN_LABELS = "train-labels-idx1-ubyte"
TEST_IMAGES = "t10k-images-idx3-ubyte"
TEST_LABELS = "t10k-labels-idx1-ubyte"
_NAMES = (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS)
#: Where, under the directory a user gives, the files may sit; searched in this order.
_SUBDIRS = ("", "MNIST/raw", "FashionMNIST/raw", "raw")


@dataclass(frozen=True)
class MnistSource:
    """Four checked IDX files (or the builtin sample): enough to load any shard later."""

    text: str  # what the user gave: "digits" or a directory
    train_images: str  # file paths; "" for the builtin
    train_labels: str
    test_images: str
    test_labels: str
    train_count: int
    test_count: int
    rows: int
    cols: int
    #: The name of the setting it came from, so that later errors (empty shard) name it too.
    field: str = "data"


@dataclass
class Images:
    """Some rows of one split, ready for a model."""

    x: np.ndarray  # float32 [n, 1, rows, cols], normalised
    y: np.ndarray  # int64 [n]
    rows: range  # which rows of the split these are
    digest: str  # SHA-256 hex of the raw image bytes then label bytes of these rows


def parse_mnist(text: str, field: str = "data") -> MnistSource:
    """Resolve the files and check their headers, so bad data fails before anyone joins a job.

    Raises ValueError naming `field` (BadDataFile, starting with the path, for a bad file).
    """
    text = text.strip()
    if not text:
        raise ValueError(f"{field}: empty MNIST source (give {DIGITS!r} or a directory)")
    if text == DIGITS:
        digits.digits_csv(field)
        side = digits.SIDE
        return MnistSource(
            text, "", "", "", "", digits.TRAIN_COUNT, digits.TEST_COUNT, side, side, field=field
        )
    paths = _resolve(text, field)
    train_count, rows, cols = idx.check_pair(paths[0], paths[1], field)
    test_count, test_rows, test_cols = idx.check_pair(paths[2], paths[3], field)
    if (test_rows, test_cols) != (rows, cols):
        raise BadDataFile(
            f"{paths[2]} ({field}): images are {test_rows}x{test_cols} "
            f"but {paths[0]} has {rows}x{cols}"
        )
    if test_count == 0:
        raise BadDataFile(f"{paths[2]} ({field}): the test set has no images")
    return MnistSource(text, *paths, train_count, test_count, rows, cols, field=field)


def check_train_shards(source: MnistSource, world: int) -> None:
    """Make sure every rank gets at least one training row, before anyone joins a job."""
    _check_world(source, world)
    for rank in range(world):
        _train_rows(source, rank, world)


def load_train_shard(source: MnistSource, rank: int, world: int) -> Images:
    """Read only the training rows `shards.plan` gives to `rank` of `world`."""
    _check_world(source, world)
    if not 0 <= rank < world:
        raise ValueError(f"{source.field}: rank {rank} is not in 0..{world - 1}")
    start, stop = _train_rows(source, rank, world)
    if source.text == DIGITS:
        return _from_digits(digits.load_digits(digits.digits_csv(source.field))[:2], start, stop)
    return _from_files(
        source, source.train_images, source.train_labels, source.train_count, start, stop
    )


def load_test(source: MnistSource) -> Images:
    """The whole test split: the server evaluates on all of it."""
    if source.text == DIGITS:
        return _from_digits(
            digits.load_digits(digits.digits_csv(source.field))[2:], 0, source.test_count
        )
    return _from_files(
        source, source.test_images, source.test_labels, source.test_count, 0, source.test_count
    )


# Planning ------------------------------------------------------------------------------------


def _check_world(source: MnistSource, world: int) -> None:
    if world < 1:
        raise ValueError(f"{source.field}: world size must be >= 1, got {world}")


def _train_rows(source: MnistSource, rank: int, world: int) -> tuple[int, int]:
    pieces = plan([source.train_count], world)[rank]
    if not pieces:
        raise EmptyShard(
            f"{source.field}: trainer rank {rank} of {world} gets no rows "
            f"(the training set has {source.train_count} images)"
        )
    (piece,) = pieces  # one file: each rank gets a single contiguous range
    return piece.start, piece.stop


def _images(images: np.ndarray, labels: np.ndarray, start: int, stop: int, digest: str) -> Images:
    # float32 division and subtraction are exactly rounded, so every member gets the same bits;
    # in place, since a 256-entry lookup table is several times slower in numpy.
    x = images.astype(np.float32)[:, None, :, :]
    x /= np.float32(255)
    x -= np.float32(MEAN)
    x /= np.float32(STD)
    return Images(
        x=x,
        y=labels.astype(np.int64),
        rows=range(start, stop),
        digest=digest,
    )


def _digest(image_bytes: bytes, label_bytes: bytes) -> str:
    h = hashlib.sha256(image_bytes)
    h.update(label_bytes)
    return h.hexdigest()


# The files -----------------------------------------------------------------------------------


def _resolve(text: str, field: str) -> tuple[str, str, str, str]:
    root = Path(text).expanduser()
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise ValueError(
            f"{field}: {text!r} {what} (give {DIGITS!r} or a directory of MNIST IDX files)"
        )
    candidates = [root / sub if sub else root for sub in _SUBDIRS]
    for folder in candidates:
        found = [_pick(folder, name) for name in _NAMES]
        if not any(found):
            continue
        missing = [folder / name for name, path in zip(_NAMES, found, strict=True) if not path]
        if missing:
            first = missing[0]
            raise BadDataFile(
                f"{first} ({field}): not found, nor {first}.gz"
                + "".join(f"; nor {path} or {path}.gz" for path in missing[1:])
            )
        return found[0], found[1], found[2], found[3]
    raise ValueError(
        f"{field}: no MNIST IDX files under {text!r}: looked for {', '.join(_NAMES)} "
        f"(each optionally .gz) in {', '.join(str(folder) for folder in candidates)}"
    )


def _pick(folder: Path, name: str) -> str:
    """The file for `name` in `folder` ("" if none), uncompressed preferred."""
    for path in (folder / name, folder / f"{name}.gz"):
        if path.is_file():
            return str(path)
    return ""


def _from_files(
    source: MnistSource, images: str, labels: str, count: int, start: int, stop: int
) -> Images:
    image_dims = (count, source.rows, source.cols)
    image_bytes = idx.read_rows(images, source.field, IMAGES_MAGIC, image_dims, start, stop)
    label_bytes = idx.read_rows(labels, source.field, LABELS_MAGIC, (count,), start, stop)
    return _images(
        np.frombuffer(image_bytes, dtype=np.uint8).reshape(stop - start, *image_dims[1:]),
        np.frombuffer(label_bytes, dtype=np.uint8),
        start,
        stop,
        _digest(image_bytes, label_bytes),
    )


# The builtin sample --------------------------------------------------------------------------


def _from_digits(split: tuple[np.ndarray, ...], start: int, stop: int) -> Images:
    images, labels = split[0][start:stop], split[1][start:stop]
    return _images(images, labels, start, stop, _digest(images.tobytes(), labels.tobytes()))
