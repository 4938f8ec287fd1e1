"""Loading one member's shard: count rows cheaply, plan, then read only the member's rows.

Every member counts the rows of every file so that all members compute the same plan
independently; then each parses only its own pieces.

Formats: CSV, Parquet and LibSVM files (`file_formats`); synthetic rows (`synthetic`);
builtin data sets, loaded whole (they are tiny), then sliced.

`digest` (in `Shard.digest`) is SHA-256 over a canonical form of the shard's values:
  dense: b"dense\\0", shape as two little-endian int64, X as C-order little-endian float32;
  CSR: b"csr\\0", shape as two int64, then indptr and indices as int64 and data as float32
  (all little-endian) of the canonical CSR (indices sorted per row, duplicates summed, explicit
  zeros kept); then y as little-endian float32.
So equal digests on two members mean they hold the same values, and the digest of a piece of
`load_all` can be recomputed with `digest(X[a:b], y[a:b])`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from coordinator.datasets import file_formats
from coordinator.datasets.file_formats import Layout
from coordinator.datasets.shards import Piece, plan
from coordinator.datasets.source import BUILTINS, DataSource
from coordinator.datasets.synthetic import synthetic_rows

Matrix = np.ndarray | sp.csr_matrix


class EmptyShard(ValueError):
    """The member's shard has no rows: the data set has fewer rows (or non-empty files to
    share out) than there are members."""


@dataclass
class Shard:
    """The rows one member trains on, and where they came from."""

    X: Matrix  # float32: dense 2-D ndarray, or CSR for LibSVM
    y: np.ndarray  # float32, 1-D
    pieces: list[Piece]
    files: list[str]  # all of the source's files; pieces index into this
    rows: int
    total_rows: int
    digest: str

    def describe(self) -> dict[str, object]:
        """A JSON-able summary, e.g. for a job's result: members can compare digests."""
        return {
            "pieces": [[self.files[p.file], p.start, p.stop] for p in self.pieces],
            "rows": self.rows,
            "features": int(self.X.shape[1]),
            "total_rows": self.total_rows,
            "digest": self.digest,
        }


def check_shards(source: DataSource, world_size: int) -> Layout:
    """Count the rows and make sure every rank gets some, before anyone joins a job.

    Every member runs this on its own and reaches the same answer, so an empty
    shard fails all of them at once, naming the rank, instead of hanging the rest.
    """
    layout = _survey(source)
    for rank, pieces in enumerate(plan(layout.row_counts, world_size)):
        if not pieces:
            raise _empty(source, layout, rank, world_size)
    return layout


def _empty(source: DataSource, layout: Layout, rank: int, world_size: int) -> EmptyShard:
    return EmptyShard(
        f"{source.field}: member rank {rank} of {world_size} gets no rows "
        f"(source has {sum(layout.row_counts)} rows in "
        f"{_count_non_empty(layout.row_counts)} non-empty file(s))"
    )


def load_shard(
    source: DataSource, rank: int, world_size: int, layout: Layout | None = None
) -> Shard:
    """Load only the rows `plan` gives to `rank`; raise EmptyShard if that is none.

    `layout` (from `check_shards`) saves counting the rows a second time.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{source.field}: rank {rank} is not in 0..{world_size - 1}")
    layout = layout or _survey(source)
    total = sum(layout.row_counts)
    pieces = plan(layout.row_counts, world_size)[rank]
    if not pieces:
        raise _empty(source, layout, rank, world_size)
    parts = [_read(source, layout, piece) for piece in pieces]
    X = _stack([X for X, _ in parts])
    y = np.concatenate([y for _, y in parts])
    return Shard(X, y, pieces, list(layout.names), int(X.shape[0]), total, digest(X, y))


def load_all(source: DataSource) -> Shard:
    """The whole data set, in file order: for single-node baselines and for checking shards."""
    return load_shard(source, 0, 1)


def digest(X: Matrix, y: np.ndarray) -> str:
    """SHA-256 hex of the canonical form described in the module docstring."""
    h = hashlib.sha256()
    if sp.issparse(X):
        csr = sp.csr_matrix(X)
        if not csr.has_canonical_format:
            csr = csr.copy()
            csr.sum_duplicates()
        h.update(b"csr\0")
        h.update(np.asarray(csr.shape, dtype="<i8").tobytes())
        h.update(np.asarray(csr.indptr, dtype="<i8").tobytes())
        h.update(np.asarray(csr.indices, dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(csr.data, dtype="<f4").tobytes())
    else:
        dense = np.ascontiguousarray(X, dtype="<f4")
        h.update(b"dense\0")
        h.update(np.asarray(dense.shape, dtype="<i8").tobytes())
        h.update(dense.tobytes())
    h.update(np.ascontiguousarray(y, dtype="<f4").tobytes())
    return h.hexdigest()


def _count_non_empty(row_counts: Iterable[int]) -> int:
    return sum(1 for count in row_counts if count > 0)


def _survey(source: DataSource) -> Layout:
    if source.kind == "synthetic":
        return Layout((source.text,), (source.rows,))
    if source.kind == "builtin":
        return Layout((source.text,), (len(_builtin(source.name)[1]),))
    if source.kind == "csv":
        return file_formats.survey_csv(source)
    if source.kind == "parquet":
        return file_formats.survey_parquet(source)
    return file_formats.survey_libsvm(source)


def _read(source: DataSource, layout: Layout, piece: Piece) -> tuple[Matrix, np.ndarray]:
    if source.kind == "synthetic":
        return synthetic_rows(source, piece.start, piece.stop)
    if source.kind == "builtin":
        X, y = _builtin(source.name)
        return X[piece.start : piece.stop].copy(), y[piece.start : piece.stop].copy()
    path = layout.names[piece.file]
    if source.kind == "csv":
        return file_formats.read_csv(source, layout, path, piece)
    if source.kind == "parquet":
        return file_formats.read_parquet(source, layout, path, piece)
    return file_formats.read_libsvm(source, layout, path, piece)


def _stack(parts: list[Matrix]) -> Matrix:
    if len(parts) == 1:
        return parts[0]
    if sp.issparse(parts[0]):
        return sp.csr_matrix(sp.vstack(parts, format="csr"))
    return np.concatenate(parts)


# builtin --------------------------------------------------------------------------------------


@functools.cache
def _builtin(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Cached: counting and reading both need it. Read-only so that no caller changes it."""
    X, y = BUILTINS[name]()
    X.setflags(write=False)
    y.setflags(write=False)
    return X, y
