"""Loading one member's shard: count rows cheaply, plan, then read only the member's rows.

Every member counts the rows of every file (Parquet: footer metadata; CSV and LibSVM: one pass
over the lines without parsing numbers) so that all members compute the same plan
independently; then each parses only its own pieces.

Formats:

* CSV: numeric and comma-separated; blank lines are ignored; a first line that is not all
  numbers is a header and skipped (decided per file). The label is the column at index
  `source.label` (Python-style, so -1 is the last column); all other columns are features.
* Parquet: the label is the column named `source.label` (or at that index); all other columns
  are features, cast to float32 (nulls become NaN). Only the row groups that overlap a piece
  are read.
* LibSVM: `label index:value ...` per non-blank line; `qid:N` tokens are skipped. Feature
  indices are taken as given (0-based, like `xgboost.DMatrix("f?format=libsvm")`), so the
  width is max index + 1. So that all members build matrices of the same width, the width is
  `source.num_features` if given (no scan; a larger index is an error), else the max index over
  ALL files, found in the counting pass by a regex over the index tokens (no value parsing).
  Explicit zeros (`3:0`) are kept as stored entries, as XGBoost does.
* synthetic: generated in blocks of `SYNTHETIC_BLOCK` rows, each from its own generators
  seeded from (seed, block), so a member generates only the blocks it overlaps and the data
  are the same whatever `world_size`. Features are float32 standard normal. The label is 1
  where x0*x1 + x2*|x3| + 0.5*noise > 0 (feature indices modulo FEATURES): an interaction
  trees must find by splitting twice. With at least 4 features the score's distribution is
  symmetric about 0 (flip the signs of x0, x2 and the noise), so classes are balanced. Only
  float32 multiplication, addition and abs are used: exactly rounded, hence identical on every
  CPU, unlike vectorised sin/exp.
* builtin: loaded whole (they are tiny), then sliced.

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
import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np
import scipy.sparse as sp

from coordinator.datasets.shards import Piece, plan
from coordinator.datasets.source import BUILTINS, DataSource

#: Rows per synthetic block: the unit of generation, independent of world_size.
SYNTHETIC_BLOCK = 1 << 16

_LINES_PER_READ = 1 << 22  # bytes hint for readlines() in counting passes
_LIBSVM_INDEX = re.compile(rb"[ \t](\d+):")

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


@dataclass(frozen=True)
class Layout:
    """What the counting pass learns: enough to plan and to read any piece consistently."""

    names: tuple[str, ...]
    row_counts: tuple[int, ...]
    width: int = 0  # csv: columns including the label; libsvm: matrix width
    label: int | str = 0  # csv: non-negative column index; parquet: column name
    columns: tuple[str, ...] = ()  # parquet: feature columns, in file order


def _count_non_empty(row_counts: Iterable[int]) -> int:
    return sum(1 for count in row_counts if count > 0)


def _survey(source: DataSource) -> Layout:
    if source.kind == "synthetic":
        return Layout((source.text,), (source.rows,))
    if source.kind == "builtin":
        return Layout((source.text,), (len(_builtin(source.name)[1]),))
    if source.kind == "csv":
        return _survey_csv(source)
    if source.kind == "parquet":
        return _survey_parquet(source)
    return _survey_libsvm(source)


def _read(source: DataSource, layout: Layout, piece: Piece) -> tuple[Matrix, np.ndarray]:
    if source.kind == "synthetic":
        return _synthetic(source, piece.start, piece.stop)
    if source.kind == "builtin":
        X, y = _builtin(source.name)
        return X[piece.start : piece.stop].copy(), y[piece.start : piece.stop].copy()
    path = layout.names[piece.file]
    if source.kind == "csv":
        return _read_csv(source, layout, path, piece)
    if source.kind == "parquet":
        return _read_parquet(source, layout, path, piece)
    return _read_libsvm(source, layout, path, piece)


def _stack(parts: list[Matrix]) -> Matrix:
    if len(parts) == 1:
        return parts[0]
    if sp.issparse(parts[0]):
        return sp.csr_matrix(sp.vstack(parts, format="csr"))
    return np.concatenate(parts)


# synthetic ------------------------------------------------------------------------------------


def _synthetic(source: DataSource, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
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


# builtin --------------------------------------------------------------------------------------


@functools.cache
def _builtin(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Cached: counting and reading both need it. Read-only so that no caller changes it."""
    X, y = BUILTINS[name]()
    X.setflags(write=False)
    y.setflags(write=False)
    return X, y


# CSV ------------------------------------------------------------------------------------------


def _is_header(line: bytes) -> bool:
    try:
        for value in line.split(b","):
            float(value)
    except ValueError:
        return True
    return False


def _csv_rows(handle: IO[bytes]) -> Iterator[bytes]:
    """The data lines of a CSV file: non-blank, after a header if there is one."""
    first = True
    for line in handle:
        if line.isspace():
            continue
        if first:
            first = False
            if _is_header(line):
                continue
        yield line


def _survey_csv(source: DataSource) -> Layout:
    counts, widths = [], {}
    for path in source.files:
        count, width = 0, 0
        with open(path, "rb") as handle:
            for line in _csv_rows(handle):
                if count == 0:
                    width = line.count(b",") + 1
                count += 1
        counts.append(count)
        if count:
            widths.setdefault(width, path)
    if len(widths) > 1:
        found = ", ".join(f"{path}: {width}" for width, path in widths.items())
        raise ValueError(f"{source.field}: CSV files have different column counts ({found})")
    width = next(iter(widths), 0)
    label = int(source.label or 0)
    if width and not -width <= label < width:
        raise ValueError(
            f"{source.field}: CSV label column {label} is out of range for {width} columns"
        )
    if width == 1:
        raise ValueError(f"{source.field}: CSV has only the label column, no features")
    return Layout(source.files, tuple(counts), width=width, label=label % max(width, 1))


def _read_csv(
    source: DataSource, layout: Layout, path: str, piece: Piece
) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as handle:
        lines = [
            line.decode() for line in itertools.islice(_csv_rows(handle), piece.start, piece.stop)
        ]
    try:
        table = np.loadtxt(lines, delimiter=",", dtype=np.float32, ndmin=2, comments=None)
    except ValueError as error:
        raise ValueError(
            f"{source.field}: {path} rows {piece.start}..{piece.stop}: {error}"
        ) from None
    if table.shape[1] != layout.width:
        raise ValueError(
            f"{source.field}: {path} rows {piece.start}..{piece.stop} have {table.shape[1]} "
            f"columns, the data set {layout.width}"
        )
    label = int(layout.label)
    return np.ascontiguousarray(np.delete(table, label, axis=1)), table[:, label].copy()


# Parquet --------------------------------------------------------------------------------------


def _survey_parquet(source: DataSource) -> Layout:
    import pyarrow.parquet as pq  # imported here: slow to import, and only Parquet needs it

    counts, names = [], None
    for path in source.files:
        with pq.ParquetFile(path) as file:
            counts.append(file.metadata.num_rows)
            columns = tuple(file.schema_arrow.names)
        if names is None:
            names = columns
        elif columns != names:
            raise ValueError(
                f"{source.field}: Parquet columns of {path} {list(columns)} differ from those "
                f"of {source.files[0]} {list(names)}"
            )
    assert names is not None  # parse_source never gives an empty file list
    label = source.label
    if isinstance(label, int):
        if not -len(names) <= label < len(names):
            raise ValueError(
                f"{source.field}: Parquet label column {label} is out of range for "
                f"{len(names)} columns"
            )
        label = names[label]
    elif label not in names:
        raise ValueError(
            f"{source.field}: Parquet has no label column {label!r} (columns: {list(names)})"
        )
    features = tuple(name for name in names if name != label)
    if not features:
        raise ValueError(f"{source.field}: Parquet has only the label column, no features")
    return Layout(source.files, tuple(counts), label=label, columns=features)


def _read_parquet(
    source: DataSource, layout: Layout, path: str, piece: Piece
) -> tuple[np.ndarray, np.ndarray]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as file:
        groups, first, offset = [], 0, 0
        for group in range(file.metadata.num_row_groups):
            size = file.metadata.row_group(group).num_rows
            if offset < piece.stop and offset + size > piece.start:
                if not groups:
                    first = offset
                groups.append(group)
            offset += size
        table = file.read_row_groups(groups, columns=[*layout.columns, str(layout.label)])
    table = table.slice(piece.start - first, piece.rows)

    def column(name: str) -> np.ndarray:
        try:
            return pc.cast(table[name], pa.float32()).to_numpy()
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            raise ValueError(
                f"{source.field}: {path} column {name!r} is not numeric: {error}"
            ) from None

    X = np.empty((table.num_rows, len(layout.columns)), dtype=np.float32)
    for index, name in enumerate(layout.columns):
        X[:, index] = column(name)
    label = table[str(layout.label)]
    if label.null_count:
        raise ValueError(f"{source.field}: {path} label column {layout.label!r} has nulls")
    return X, column(str(layout.label))


# LibSVM ---------------------------------------------------------------------------------------


def _survey_libsvm(source: DataSource) -> Layout:
    counts, width = [], 0
    scan = source.num_features is None
    for path in source.files:
        count = 0
        with open(path, "rb") as handle:
            while lines := handle.readlines(_LINES_PER_READ):
                count += sum(1 for line in lines if not line.isspace())
                if scan:
                    found = _LIBSVM_INDEX.findall(b"".join(lines))
                    if found:
                        width = max(width, max(map(int, found)) + 1)
        counts.append(count)
    if not scan:
        width = int(source.num_features or 0)
    return Layout(source.files, tuple(counts), width=width)


def _read_libsvm(
    source: DataSource, layout: Layout, path: str, piece: Piece
) -> tuple[sp.csr_matrix, np.ndarray]:
    labels: list[float] = []
    indices: list[int] = []
    values: list[float] = []
    indptr = [0]
    with open(path, "rb") as handle:
        rows = (line for line in handle if not line.isspace())
        for row, line in enumerate(itertools.islice(rows, piece.start, piece.stop), piece.start):
            tokens = line.split()
            try:
                labels.append(float(tokens[0]))
                for token in tokens[1:]:
                    index, colon, value = token.partition(b":")
                    if index == b"qid":
                        continue
                    if not colon:
                        raise ValueError(
                            f"token {token.decode(errors='replace')!r} is not index:value"
                        )
                    indices.append(int(index))
                    values.append(float(value))
            except ValueError as error:
                raise ValueError(f"{source.field}: {path} data row {row}: {error}") from None
            indptr.append(len(indices))
    columns = np.asarray(indices, dtype=np.int64)
    bad = np.flatnonzero((columns < 0) | (columns >= layout.width))
    if bad.size:
        row = piece.start + int(np.searchsorted(indptr, bad[0], side="right")) - 1
        how = "given" if source.num_features is not None else "max index + 1 over all files"
        raise ValueError(
            f"{source.field}: {path} data row {row}: feature index {columns[bad[0]]} is "
            f"outside 0..{layout.width - 1} (width {layout.width}: {how})"
        )
    X = sp.csr_matrix(
        (np.asarray(values, dtype=np.float32), columns, np.asarray(indptr, dtype=np.int64)),
        shape=(len(labels), layout.width),
    )
    X.sum_duplicates()
    return X, np.asarray(labels, dtype=np.float32)
