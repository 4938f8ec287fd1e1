"""Row shards: the plan is a partition, every format's shards add up to the whole data set, and
bad sources fail with errors that name the setting. Real files in tmp_path throughout."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.datasets import (
    DataSource,
    EmptyShard,
    Piece,
    Shard,
    digest,
    load_all,
    load_shard,
    parse_source,
    plan,
)
from coordinator.datasets.shards import by_file
from coordinator.datasets.synthetic import SYNTHETIC_BLOCK

# plan ----------------------------------------------------------------------------------------

counts_strategy = st.lists(st.integers(min_value=0, max_value=40), max_size=10)
world_strategy = st.integers(min_value=1, max_value=9)


@settings(max_examples=300, deadline=None)
@given(counts_strategy, world_strategy)
def test_plan_covers_every_row_exactly_once(counts: list[int], world_size: int) -> None:
    ranks = plan(counts, world_size)
    assert len(ranks) == world_size
    assert plan(counts, world_size) == ranks  # deterministic
    seen: dict[int, list[tuple[int, int]]] = {}
    for pieces in ranks:
        for piece in pieces:
            assert 0 <= piece.start < piece.stop <= counts[piece.file]
            seen.setdefault(piece.file, []).append((piece.start, piece.stop))
    for file, count in enumerate(counts):
        ranges = sorted(seen.get(file, []))
        position = 0
        for start, stop in ranges:  # sorted, touching, no gaps: disjoint and covering
            assert start == position
            position = stop
        assert position == count


@settings(max_examples=300, deadline=None)
@given(counts_strategy, world_strategy)
def test_plan_mode(counts: list[int], world_size: int) -> None:
    ranks = plan(counts, world_size)
    non_empty = sum(1 for count in counts if count)
    if non_empty >= world_size:
        assert by_file(counts, world_size)
        for pieces in ranks:
            assert pieces, "by file: every rank gets at least one file"
            assert pieces == sorted(pieces)
            for piece in pieces:
                assert (piece.start, piece.stop) == (0, counts[piece.file])
    else:
        assert not by_file(counts, world_size)
        sizes = [sum(piece.rows for piece in pieces) for pieces in ranks]
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)  # lower ranks get the extra rows
        order = [(piece.file, piece.start, piece.stop) for pieces in ranks for piece in pieces]
        assert order == sorted(order)  # rank order is data order


def test_plan_by_file_is_greedy_largest_first() -> None:
    # 10 -> r0, 7 -> r1, 5 -> r1 (7 < 10), 1 -> r0 (11 vs 12) ... then listed in file order.
    ranks = plan([1, 10, 0, 5, 7], 2)
    assert ranks == [[Piece(0, 0, 1), Piece(1, 0, 10)], [Piece(3, 0, 5), Piece(4, 0, 7)]]


def test_plan_by_rows_and_empty_ranks() -> None:
    assert plan([3, 2], 3) == [[Piece(0, 0, 2)], [Piece(0, 2, 3), Piece(1, 0, 1)], [Piece(1, 1, 2)]]
    assert plan([2], 4) == [[Piece(0, 0, 1)], [Piece(0, 1, 2)], [], []]
    assert plan([], 2) == [[], []]
    with pytest.raises(ValueError, match="world_size"):
        plan([3], 0)


# data sets on disk ---------------------------------------------------------------------------


def _table(rng: np.random.Generator, rows: int, features: int) -> np.ndarray:
    """Values exactly representable in float32 (quarters), so every parser agrees bit for bit."""
    return rng.integers(-40, 40, size=(rows, features)).astype(np.float64) / 4


def _write_csv(path: Path, table: np.ndarray, header: bool, blank_line: bool = False) -> None:
    lines = [",".join(f"{value:g}" for value in row) for row in table]
    if blank_line:
        lines.insert(len(lines) // 2, "")
    if header:
        lines.insert(0, ",".join(f"col{i}" for i in range(table.shape[1])))
    path.write_text("\n".join(lines) + "\n")


def _write_libsvm(path: Path, table: np.ndarray, labels: np.ndarray) -> None:
    lines = []
    for i, (row, label) in enumerate(zip(table, labels, strict=True)):
        tokens = [f"{label:g}"]
        if i % 3 == 0:
            tokens.append(f"qid:{i}")
        tokens += [f"{j}:{value:g}" for j, value in enumerate(row) if value > 0 or j == 1]
        lines.append(" ".join(tokens))
        if i % 4 == 1:
            lines.append("   ")
    path.write_text("\n".join(lines) + "\n")


def csv_header(tmp_path: Path) -> DataSource:
    rng = np.random.default_rng(1)
    _write_csv(tmp_path / "a.csv", _table(rng, 7, 4), header=True)
    _write_csv(tmp_path / "b.csv", _table(rng, 4, 4), header=True)
    return parse_source(str(tmp_path / "*.csv"), label_column="-1")


def csv_plain(tmp_path: Path) -> DataSource:
    rng = np.random.default_rng(2)
    _write_csv(tmp_path / "a.csv", _table(rng, 6, 3), header=False, blank_line=True)
    _write_csv(tmp_path / "b.csv", _table(rng, 5, 3), header=False)
    return parse_source(str(tmp_path / "[ab].csv"))


def parquet(tmp_path: Path) -> DataSource:
    rng = np.random.default_rng(3)
    for name, rows in (("a.parquet", 9), ("b.pq", 4)):
        data = _table(rng, rows, 3)
        table = pa.table(
            {"f0": data[:, 0], "target": (data[:, 1] > 0).astype(np.int64), "f2": data[:, 2]}
        )
        pq.write_table(table, tmp_path / name, row_group_size=2)
    return parse_source(str(tmp_path / "*"), label_column="target")


def libsvm(tmp_path: Path) -> DataSource:
    rng = np.random.default_rng(4)
    _write_libsvm(tmp_path / "a.libsvm", _table(rng, 8, 5), rng.integers(0, 2, 8))
    _write_libsvm(tmp_path / "b.svm", _table(rng, 5, 6), rng.integers(0, 2, 5))
    return parse_source(str(tmp_path / "*"))


def synthetic(tmp_path: Path) -> DataSource:
    return parse_source(f"synthetic:{SYNTHETIC_BLOCK + 2000}x4:3")  # crosses a block edge


def breast_cancer(tmp_path: Path) -> DataSource:
    return parse_source("breast_cancer")


MAKERS: list[Callable[[Path], DataSource]] = [
    csv_header,
    csv_plain,
    parquet,
    libsvm,
    synthetic,
    breast_cancer,
]


def _dense(X: np.ndarray | sp.csr_matrix) -> np.ndarray:
    return X.toarray() if sp.issparse(X) else X


def _rows_of(whole: Shard, shard: Shard) -> np.ndarray:
    """The row numbers in `whole` (all files in order) of the rows of `shard`."""
    offsets = np.cumsum([0] + [whole.pieces[i].rows for i in range(len(whole.pieces))])
    by_file = {piece.file: offset for piece, offset in zip(whole.pieces, offsets, strict=False)}
    return np.concatenate(
        [np.arange(piece.start, piece.stop) + by_file[piece.file] for piece in shard.pieces]
    )


@pytest.mark.parametrize("make", MAKERS, ids=lambda make: make.__name__)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shards_add_up_to_the_whole(
    make: Callable[[Path], DataSource], world_size: int, tmp_path: Path
) -> None:
    source = make(tmp_path)
    whole = load_all(source)
    assert whole.rows == whole.total_rows == whole.X.shape[0] == whole.y.shape[0]
    assert whole.X.dtype == np.float32 and whole.y.dtype == np.float32
    assert sp.issparse(whole.X) == (source.kind == "libsvm")
    assert whole.digest == digest(whole.X, whole.y)

    shards = [load_shard(source, rank, world_size) for rank in range(world_size)]
    rows = [_rows_of(whole, shard) for shard in shards]
    assert sorted(np.concatenate(rows).tolist()) == list(range(whole.rows))
    for shard, index in zip(shards, rows, strict=True):
        assert shard.rows == len(index) == shard.X.shape[0]
        assert shard.total_rows == whole.rows
        assert shard.X.shape[1] == whole.X.shape[1]  # the same width on every member
        np.testing.assert_array_equal(_dense(shard.X), _dense(whole.X[index]))
        np.testing.assert_array_equal(shard.y, whole.y[index])
        assert shard.digest == digest(whole.X[index], whole.y[index])
        described = json.loads(json.dumps(shard.describe()))
        assert described["digest"] == shard.digest and described["rows"] == shard.rows
        assert [piece[0] for piece in described["pieces"]] == [
            shard.files[piece.file] for piece in shard.pieces
        ]
    if not by_file([piece.rows for piece in whole.pieces], world_size) or world_size == 1:
        # By row ranges (and trivially for one member): rank order is the data order.
        together = (sp.vstack if source.kind == "libsvm" else np.concatenate)(
            [shard.X for shard in shards]
        )
        np.testing.assert_array_equal(_dense(together), _dense(whole.X))
        np.testing.assert_array_equal(np.concatenate([s.y for s in shards]), whole.y)


def test_both_modes_are_exercised(tmp_path: Path) -> None:
    source = csv_plain(tmp_path)
    assert [piece.file for piece in load_shard(source, 1, 2).pieces] == [1]  # by file
    assert load_shard(source, 1, 3).pieces == [Piece(0, 4, 6), Piece(1, 0, 2)]  # by row range


def test_csv_header_is_detected(tmp_path: Path) -> None:
    table = _table(np.random.default_rng(5), 6, 3)
    _write_csv(tmp_path / "with.csv", table, header=True)
    _write_csv(tmp_path / "without.csv", table, header=False)
    with_header = load_all(parse_source(str(tmp_path / "with.csv")))
    without = load_all(parse_source(str(tmp_path / "without.csv")))
    assert with_header.rows == 6
    np.testing.assert_array_equal(with_header.X, table[:, 1:].astype(np.float32))
    np.testing.assert_array_equal(with_header.y, table[:, 0].astype(np.float32))
    assert with_header.digest == without.digest


def test_parquet_label_by_index(tmp_path: Path) -> None:
    pq.write_table(pa.table({"a": [1.0, 2.0], "label": [0, 1], "b": [3, 4]}), tmp_path / "d.pq")
    by_default = load_all(parse_source(str(tmp_path / "d.pq")))
    by_index = load_all(parse_source(str(tmp_path / "d.pq"), label_column="1"))
    np.testing.assert_array_equal(by_default.X, [[1, 3], [2, 4]])
    np.testing.assert_array_equal(by_default.y, [0, 1])
    assert by_index.digest == by_default.digest


@pytest.mark.filterwarnings("ignore::UserWarning")  # XGBoost deprecates text input
def test_libsvm_matches_xgboost(tmp_path: Path) -> None:
    import xgboost

    source = libsvm(tmp_path)
    whole = load_all(source)
    for path in source.files:
        matrix = xgboost.DMatrix(f"{path}?format=libsvm")
        own = load_all(parse_source(path))
        assert own.X.shape == (matrix.num_row(), matrix.num_col())
        np.testing.assert_array_equal(own.X.toarray(), matrix.get_data().toarray())
        np.testing.assert_array_equal(own.y, matrix.get_label())
        assert own.X.nnz == matrix.get_data().nnz  # explicit zeros kept, like XGBoost
    assert whole.X.shape[1] == 6  # max index 5 over both files, though a.libsvm only has 0..4


def test_libsvm_num_features(tmp_path: Path) -> None:
    (tmp_path / "d.libsvm").write_text("1 0:1 2:3\n0 1:2\n")
    wide = load_all(parse_source(str(tmp_path / "d.libsvm"), num_features=10))
    assert wide.X.shape == (2, 10)
    with pytest.raises(ValueError, match=r"data: .*data row 0: feature index 2 is outside 0\.\.1"):
        load_all(parse_source(str(tmp_path / "d.libsvm"), num_features=2))


def test_synthetic_is_the_same_for_every_world_size() -> None:
    source = parse_source(f"synthetic:{2 * SYNTHETIC_BLOCK + 5}x3:11")
    whole = load_all(source)
    for world_size in (2, 3, 7):
        shards = [load_shard(source, rank, world_size) for rank in range(world_size)]
        np.testing.assert_array_equal(np.concatenate([s.X for s in shards]), whole.X)
        np.testing.assert_array_equal(np.concatenate([s.y for s in shards]), whole.y)
    # A prefix does not depend on the row count, and the seed matters.
    shorter = load_all(parse_source("synthetic:1000x3:11"))
    np.testing.assert_array_equal(shorter.X, whole.X[:1000])
    np.testing.assert_array_equal(shorter.y, whole.y[:1000])
    other = load_all(parse_source("synthetic:1000x3:12"))
    assert other.digest != shorter.digest
    assert parse_source("synthetic:1000x3").seed == 0


def test_synthetic_labels_are_balanced_and_learnable() -> None:
    import xgboost

    train = load_all(parse_source("synthetic:20000x6:1"))
    test = load_all(parse_source("synthetic:5000x6:2"))
    assert 0.45 < train.y.mean() < 0.55
    x = train.X
    score = x[:, 0] * x[:, 1] + x[:, 2] * np.abs(x[:, 3])
    assert ((score > 0) == train.y.astype(bool)).mean() > 0.8  # the noise flips only some
    booster = xgboost.train(
        {"objective": "binary:logistic", "max_depth": 4, "nthread": 2},
        xgboost.DMatrix(train.X, label=train.y),
        num_boost_round=30,
    )
    predicted = booster.predict(xgboost.DMatrix(test.X)) > 0.5
    assert (predicted == test.y.astype(bool)).mean() > 0.75


def test_empty_shard_names_the_rank(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("1,2,3\n0,5,6\n")
    source = parse_source(str(tmp_path / "d.csv"), field="train_data")
    assert load_shard(source, 1, 4).rows == 1
    with pytest.raises(EmptyShard, match=r"^train_data: member rank 3 of 4 gets no rows"):
        load_shard(source, 3, 4)
    with pytest.raises(ValueError, match=r"source has 2 rows"):
        load_shard(source, 2, 4)
    with pytest.raises(ValueError, match=r"train_data: rank 4 is not in 0\.\.3"):
        load_shard(source, 4, 4)


# bad input -----------------------------------------------------------------------------------


def test_unknown_format(tmp_path: Path) -> None:
    (tmp_path / "d.txt").write_text("1,2\n")
    with pytest.raises(ValueError, match=r"^train_data: unknown format of .*d\.txt"):
        parse_source(str(tmp_path / "d.txt"), field="train_data")
    with pytest.raises(ValueError, match=r"^data: unknown format of .*missing\.json"):
        parse_source(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"^data: unknown format of .*d\.txt"):
        parse_source(str(tmp_path / "d*"))


@pytest.mark.parametrize(
    "text", ["synthetic:", "synthetic:100", "synthetic:100x", "synthetic:ax3", "synthetic:0x3"]
)
def test_malformed_synthetic(text: str) -> None:
    with pytest.raises(ValueError, match=r"^eval_data: malformed synthetic spec"):
        parse_source(text, field="eval_data")


def test_no_file_matches(tmp_path: Path) -> None:
    pattern = str(tmp_path / "*.parquet")
    with pytest.raises(ValueError, match="^data: no file matches " + re.escape(repr(pattern))):
        parse_source(pattern)
    missing = str(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="^data: no file matches " + re.escape(repr(missing))):
        parse_source(missing)


def test_mixed_formats(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("1,2\n")
    pq.write_table(pa.table({"label": [1], "x": [2.0]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"^data: mixed formats"):
        parse_source(str(tmp_path / "*"))


def test_unknown_builtin() -> None:
    with pytest.raises(ValueError, match=r"^data: unknown builtin data set 'iris'.*breast_cancer"):
        parse_source("iris")


def test_bad_label_columns(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("1,2\n")
    (tmp_path / "d.libsvm").write_text("1 0:2\n")
    pq.write_table(pa.table({"y": [1], "x": [2.0]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"^data: CSV label column must be a column index"):
        parse_source(str(tmp_path / "d.csv"), label_column="label")
    with pytest.raises(ValueError, match=r"^data: CSV label column 5 is out of range"):
        load_all(parse_source(str(tmp_path / "d.csv"), label_column="5"))
    with pytest.raises(ValueError, match=r"^data: a label column cannot be chosen for LibSVM"):
        parse_source(str(tmp_path / "d.libsvm"), label_column="0")
    with pytest.raises(ValueError, match=r"^data: Parquet has no label column 'label'"):
        load_all(parse_source(str(tmp_path / "d.parquet")))
    with pytest.raises(ValueError, match=r"^data: a label column cannot be chosen for synthetic"):
        parse_source("synthetic:10x2", label_column="0")


def test_bad_file_contents(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("1,2,3\n4,5,6\n")
    (tmp_path / "b.csv").write_text("1,2\n")
    with pytest.raises(ValueError, match=r"^data: CSV files have different column counts"):
        load_all(parse_source(str(tmp_path / "*.csv")))
    (tmp_path / "c.libsvm").write_text("1 0:2 junk\n")
    with pytest.raises(ValueError, match=r"^data: .*c\.libsvm data row 0: token 'junk'"):
        load_all(parse_source(str(tmp_path / "c.libsvm")))
    with pytest.raises(ValueError, match=r"^data: .* is a directory"):
        parse_source(str(tmp_path))
    with pytest.raises(ValueError, match=r"^data: empty data source"):
        parse_source("  ")
