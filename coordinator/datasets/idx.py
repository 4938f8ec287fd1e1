"""The IDX file format of MNIST: checking a file's header, reading some of its rows.

IDX: a big-endian header of two zero bytes, a type byte (only 0x08, unsigned byte, is
accepted), a byte counting the dimensions, then one uint32 size per dimension; then the data in
C order. Images are 0x00000803 (count, rows, cols); labels 0x00000801 (count,).

An uncompressed file's size is checked against its header up front; a .gz one's only as far
as its rows are read (its size is not known without decompressing it all).
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

import numpy as np

IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801
_CHUNK = 1 << 20  # bytes per read when skipping through a .gz


class BadDataFile(ValueError):
    """A data file is missing, malformed or disagrees with its partner; the message starts with
    the file's path."""


def check_pair(images: str, labels: str, field: str) -> tuple[int, int, int]:
    """(count, rows, cols) of an images file and its labels file, after checking both."""
    count, rows, cols = _check_file(images, IMAGES_MAGIC, field)
    (label_count,) = _check_file(labels, LABELS_MAGIC, field)
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
        what = "images" if magic == IMAGES_MAGIC else "labels"
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


def read_rows(
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
