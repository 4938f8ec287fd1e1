"""A job's KEY=VALUE parameters: reading them, with errors that name the job and the field."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

from coordinator.datasets.source import is_shape_only

ARTIFACTS_ROOT_ENV = "COORDINATOR_ARTIFACTS_ROOT"  # set by `coordinator serve` for its members


def parse_params(items: list[str]) -> dict[str, str]:
    """`["a=1", "b=x,y"]` (repeated --param) to a dict: each item is one KEY=VALUE, split at
    its first `=` only, so a value keeps its commas and can never become two parameters."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"job parameter {item!r} is not KEY=VALUE")
        params[key.strip()] = value.strip()
    return params


def parse_param_list(text: str) -> dict[str, str]:
    """`"a=1,b=2"`: the comma-separated form of $COORDINATOR_PARAMS (an operator's manifest,
    never a submitted job: the service passes each parameter as a --param of its own)."""
    return parse_params([part for part in (p.strip() for p in text.split(",")) if part])


def check_known(job: str, params: dict[str, str], known: Iterable[str]) -> None:
    names = list(known)
    unknown = set(params) - set(names)
    if unknown:
        raise ValueError(
            f"{job} job: unknown parameter(s) {', '.join(sorted(unknown))} "
            f"(known: {', '.join(names)})"
        )


def int_param(
    job: str, params: dict[str, str], name: str, default: int | None = None
) -> int | None:
    if name not in params:
        return default
    try:
        return int(params[name])
    except ValueError:
        raise ValueError(
            f"{job} job: parameter {name}={params[name]!r} is not an integer"
        ) from None


def int_at_least(
    job: str,
    params: dict[str, str],
    name: str,
    default: int,
    minimum: int,
    maximum: float | None = None,
) -> int:
    """An integer of at least `minimum` (a count, a seed) and at most `maximum` where the
    catalog gives one: the error names the bound."""
    value = int_param(job, params, name, default)
    assert value is not None
    if value < minimum:
        raise ValueError(f"{job} job: parameter {name} must be >= {minimum}, got {value}")
    _at_most(job, name, value, maximum)
    return value


def float_param(
    job: str, params: dict[str, str], name: str, default: float, maximum: float | None = None
) -> float:
    """A finite non-negative number (durations, factors), at most `maximum` where the
    catalog gives one (`inf` or `1e308` seconds would overflow a timer in the member)."""
    if name not in params:
        return default
    try:
        value = float(params[name])
    except ValueError:
        raise ValueError(f"{job} job: parameter {name}={params[name]!r} is not a number") from None
    if not value >= 0 or not math.isfinite(value):
        raise ValueError(
            f"{job} job: parameter {name} must be a finite number >= 0, got {params[name]!r}"
        )
    _at_most(job, name, value, maximum)
    return value


def _at_most(job: str, name: str, value: float, maximum: float | None) -> None:
    if maximum is not None and value > maximum:
        raise ValueError(
            f"{job} job: parameter {name} must be <= {_number(maximum)}, got {_number(value)}"
        )


def _number(value: float) -> str:
    """A bound or a value as a person reads it: no `1e+06` for a million, and a
    400-digit integer cut short."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    text = str(value) if isinstance(value, int) else f"{value:g}"
    return text if len(text) <= 24 else text[:21] + "..."


def artifacts_dir(job: str, params: dict[str, str]) -> Path:
    """Where a job saves its model: `artifacts`, else $COORDINATOR_ARTIFACTS, else
    ./artifacts; created and checked writable before the member joins (and under
    $COORDINATOR_ARTIFACTS_ROOT, symlinks followed, where that is set)."""
    path = Path(
        params.get("artifacts") or os.environ.get("COORDINATOR_ARTIFACTS") or "artifacts"
    ).absolute()
    if is_shape_only():
        return path
    root = os.environ.get(ARTIFACTS_ROOT_ENV)
    if root:
        real, real_root = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, real_root]) != real_root:
            raise ValueError(f"{job} job: parameter artifacts: {path} is outside {root}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{job} job: parameter artifacts: cannot create {path}: {exc}") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"{job} job: parameter artifacts: {path} is not writable")
    return path
