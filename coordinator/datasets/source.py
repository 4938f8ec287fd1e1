"""What a job trains on, parsed from one string so that a CLI flag or a job parameter can name it.

Parsing resolves globs to a sorted file list up front: every member must see the same files in
the same order, since shards are planned over file indices. It does no reading beyond that.
Under `shape_only()` (the REST API checking a submitted job) it does not even that: a path's
format comes from its name, and the members, which read the files, resolve the glob. Where
`COORDINATOR_DATA_ROOT` is set (members of `coordinator serve`), every file must resolve,
symlinks followed, to a place under it.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy as np

Kind = Literal["synthetic", "builtin", "csv", "parquet", "libsvm"]

#: File name endings (lower case) and the format they mean.
EXTENSIONS: dict[str, Kind] = {
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".libsvm": "libsvm",
    ".svm": "libsvm",
}

_SYNTHETIC = re.compile(r"(\d+)x(\d+)(?::(\d+))?")
_GLOB_CHARS = ("*", "?", "[")
DATA_ROOT_ENV = "COORDINATOR_DATA_ROOT"  # set by `coordinator serve` for its members
_SHAPE_ONLY: ContextVar[bool] = ContextVar("shape_only", default=False)


@contextmanager
def shape_only() -> Iterator[None]:
    """Parse sources (and job parameters) without touching the disk: no glob, no stat, no
    folder made. The REST API checks a submitted job so; only its members read files."""
    token = _SHAPE_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPE_ONLY.reset(token)


def is_shape_only() -> bool:
    return _SHAPE_ONLY.get()


def _breast_cancer() -> tuple[np.ndarray, np.ndarray]:
    # Imported here: scikit-learn is slow to import and only this builtin needs it.
    import numpy as np
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    return np.ascontiguousarray(X, dtype=np.float32), np.asarray(y, dtype=np.float32)


#: Small real data sets that need no file: name -> loader of the whole (X, y).
BUILTINS: dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]] = {
    "breast_cancer": _breast_cancer,
}


@dataclass(frozen=True)
class DataSource:
    """A parsed data source. Which fields matter depends on `kind`."""

    kind: Kind
    #: The text it was parsed from; also the "file" name of synthetic and builtin data.
    text: str
    #: The name of the setting it came from, so that later errors (empty shard) name it too.
    field: str = "data"
    #: csv/parquet/libsvm: the matched files, sorted.
    files: tuple[str, ...] = ()
    #: csv: label column index; parquet: label column name or index; else None.
    label: int | str | None = None
    #: synthetic: shape and seed.
    rows: int = 0
    features: int = 0
    seed: int = 0
    #: builtin: its key in BUILTINS.
    name: str = ""
    #: libsvm: the matrix width; None means max feature index + 1 over all files (a scan).
    num_features: int | None = None


def parse_source(
    text: str,
    *,
    field: str = "data",
    label_column: str | None = None,
    num_features: int | None = None,
) -> DataSource:
    """Parse `synthetic:ROWSxFEATURES[:SEED]`, a builtin name, or a file path/glob.

    Raises ValueError naming `field` for anything it cannot use.
    """
    text = text.strip()
    if not text:
        raise ValueError(f"{field}: empty data source")
    if num_features is not None and num_features < 1:
        raise ValueError(f"{field}: num_features must be >= 1, got {num_features}")

    if text.startswith("synthetic:"):
        _no_label(field, label_column, "synthetic data")
        _no_width(field, num_features, "synthetic data")
        match = _SYNTHETIC.fullmatch(text.removeprefix("synthetic:"))
        if match is None:
            raise ValueError(
                f"{field}: malformed synthetic spec {text!r} "
                "(expected synthetic:ROWSxFEATURES or synthetic:ROWSxFEATURES:SEED)"
            )
        rows, features = int(match[1]), int(match[2])
        if rows < 1 or features < 1:
            raise ValueError(
                f"{field}: malformed synthetic spec {text!r} (needs rows, features >= 1)"
            )
        return DataSource(
            "synthetic", text, field, rows=rows, features=features, seed=int(match[3] or 0)
        )

    if text in BUILTINS:
        _no_label(field, label_column, f"builtin data set {text}")
        _no_width(field, num_features, f"builtin data set {text}")
        return DataSource("builtin", text, field, name=text)
    if _looks_like_name(text):
        raise ValueError(
            f"{field}: unknown builtin data set {text!r} (known: {', '.join(sorted(BUILTINS))}; "
            "or give synthetic:ROWSxFEATURES or a .csv/.parquet/.libsvm path)"
        )

    files = [text] if is_shape_only() else _confined(_match_files(text, field), field)
    kind = _format_of(files, field)
    label: int | str | None
    if kind == "csv":
        label = 0 if label_column is None else _int_label(label_column, field)
        _no_width(field, num_features, "CSV")
    elif kind == "parquet":
        if importlib.util.find_spec("pyarrow") is None:
            raise ValueError(
                f"{field}: Parquet files need pyarrow: pip install 'etcd-coordinator[parquet]'"
            )
        label = "label" if label_column is None else _parquet_label(label_column)
        _no_width(field, num_features, "Parquet")
    else:
        _no_label(field, label_column, "LibSVM (it carries its own label)")
        label = None
    return DataSource(kind, text, field, files=tuple(files), label=label, num_features=num_features)


def _looks_like_name(text: str) -> bool:
    """A bare word (no directory, extension or glob) that is no file: meant as a builtin."""
    return not any(char in text for char in (*_GLOB_CHARS, ".", "/", os.sep)) and (
        is_shape_only() or not os.path.exists(text)
    )


def _confined(files: list[str], field: str) -> list[str]:
    """The files, if each resolves (symlinks followed) under $COORDINATOR_DATA_ROOT."""
    root = os.environ.get(DATA_ROOT_ENV)
    if not root:
        return files
    real_root = os.path.realpath(root)
    for path in files:
        real = os.path.realpath(path)
        if os.path.commonpath([real, real_root]) != real_root:
            raise ValueError(f"{field}: {path!r} is outside the data root {root}")
    return files


def _match_files(text: str, field: str) -> list[str]:
    pattern = os.path.expanduser(text)
    if any(char in pattern for char in _GLOB_CHARS):
        files = sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))
        if not files:
            raise ValueError(f"{field}: no file matches {text!r}")
        return files
    if os.path.isdir(pattern):
        raise ValueError(
            f"{field}: {text!r} is a directory; give a glob such as {text.rstrip('/')}/*.parquet"
        )
    # The format error comes first: it is the clearer one for a typo such as data.txt.
    if _extension(pattern) not in EXTENSIONS:
        _format_of([pattern], field)
    if not os.path.isfile(pattern):
        raise ValueError(f"{field}: no file matches {text!r}")
    return [pattern]


def _extension(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _format_of(files: list[str], field: str) -> Kind:
    kinds: dict[Kind, str] = {}
    for path in files:
        kind = EXTENSIONS.get(_extension(path))
        if kind is None:
            raise ValueError(
                f"{field}: unknown format of {path!r}: not a builtin data set "
                f"({', '.join(sorted(BUILTINS))}), not synthetic:ROWSxFEATURES, and the "
                f"extension is none of {', '.join(EXTENSIONS)}"
            )
        kinds.setdefault(kind, path)
    if len(kinds) > 1:
        examples = ", ".join(f"{kind} ({path})" for kind, path in kinds.items())
        raise ValueError(f"{field}: mixed formats in one data set: {examples}")
    return next(iter(kinds))


def _int_label(label_column: str, field: str) -> int:
    try:
        return int(label_column)
    except ValueError:
        raise ValueError(
            f"{field}: CSV label column must be a column index, got {label_column!r}"
        ) from None


def _parquet_label(label_column: str) -> int | str:
    try:
        return int(label_column)
    except ValueError:
        return label_column


def _no_label(field: str, label_column: str | None, what: str) -> None:
    if label_column is not None:
        raise ValueError(f"{field}: a label column cannot be chosen for {what}")


def _no_width(field: str, num_features: int | None, what: str) -> None:
    if num_features is not None:
        raise ValueError(f"{field}: num_features applies to LibSVM only, not {what}")
