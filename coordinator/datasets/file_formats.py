"""Counting and reading the rows of data files: CSV, Parquet and LibSVM.

Each format has a survey (every file's row count, from Parquet's footer metadata or one pass
over the lines without parsing numbers: cheap, so that every member plans alike) and a
reader of one piece (a contiguous range of one file's rows), which parses only that.

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
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np
import scipy.sparse as sp

from coordinator.datasets.shards import Piece
from coordinator.datasets.source import DataSource

_LINES_PER_READ = 1 << 22  # bytes hint for readlines() in counting passes
_LIBSVM_INDEX = re.compile(rb"[ \t](\d+):")


@dataclass(frozen=True)
class Layout:
    """What the counting pass learns: enough to plan and to read any piece consistently."""

    names: tuple[str, ...]
    row_counts: tuple[int, ...]
    width: int = 0  # csv: columns including the label; libsvm: matrix width
    label: int | str = 0  # csv: non-negative column index; parquet: column name
    columns: tuple[str, ...] = ()  # parquet: feature columns, in file order


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


def survey_csv(source: DataSource) -> Layout:
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


def read_csv(
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


def survey_parquet(source: DataSource) -> Layout:
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


def read_parquet(
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


def survey_libsvm(source: DataSource) -> Layout:
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


def read_libsvm(
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
