"""Every kind's parameters: name, type, default and what it does.

Kept apart from the jobs themselves so the service, the dashboard and the CLI
learn a kind's parameters without importing PyTorch or XGBoost; each job's own
check reads its list of known names from here, so the two cannot drift. The
parameters are data, in `catalog.toml` beside this module (package data); this
module reads them once, at import, and checks every entry against `Param`.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

ParamType = Literal["integer", "number", "boolean", "text", "choice", "path"]
#: What a parameter counts that the host has only so much of: `threads`, capped by the
#: service's `--max-threads` (coordinator/jobs/threads.py).
Cap = Literal["threads"]
CATALOG_FILE = "catalog.toml"


class Param(BaseModel):
    """One KEY=VALUE parameter of a kind (values travel as text: `default` too)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    type: ParamType
    description: str
    default: str | None = None  # None: none, or one the description explains
    choices: tuple[str, ...] = ()
    cap: Cap | None = None  # the host resource the value counts, at most the service's cap
    maximum: float | None = None  # the largest value a member takes (checked at submit too)


class PassThrough(BaseModel):
    """Text parameters handed on as given (XGBoost's booster's): one description for all,
    and a default for the few that have one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    description: str
    names: tuple[str, ...]
    defaults: dict[str, str] = {}

    def params(self) -> tuple[Param, ...]:
        return tuple(
            Param(
                name=name,
                type="text",
                default=self.defaults.get(name),
                description=self.description,
            )
            for name in self.names
        )


def names(params: tuple[Param, ...]) -> list[str]:
    return [param.name for param in params]


class Use(BaseModel):
    """A `[[kind]]` block that takes a shared group's parameters where it stands, with
    the kind's own defaults or descriptions for some of them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    use: str
    defaults: dict[str, str] = {}
    descriptions: dict[str, str] = {}


def load(text: str, source: str = CATALOG_FILE) -> dict[str, tuple[Param, ...]]:
    """Each kind's parameters from catalog TOML: a `[[kind]]` block a parameter (or one
    that uses a `[[groups.<name>]]` group of them), or a `[kind]` table of pass-through
    ones. A ValueError names the file, the kind, the parameter and the field, so a slip in
    the data fails at import and says where."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{source}: {error}") from error
    groups = document.pop("groups", {})
    if not isinstance(groups, dict):
        raise ValueError(f"{source}: groups: not a table of [[groups.<name>]] blocks")
    shared = {name: _kind_params(f"{source}: groups.{name}", entries, {})
              for name, entries in groups.items()}  # fmt: skip
    return {
        kind: _kind_params(f"{source}: {kind}", entries, shared)
        for kind, entries in document.items()
    }


def _kind_params(
    where: str, entries: Any, groups: dict[str, tuple[Param, ...]]
) -> tuple[Param, ...]:
    if isinstance(entries, list):
        params = tuple(
            param
            for index, entry in enumerate(entries)
            for param in (
                _used(where, index, entry, groups)
                if isinstance(entry, dict) and "use" in entry
                else (_param(where, index, entry),)
            )
        )
    elif isinstance(entries, dict):
        params = _pass_through(where, entries)
    else:
        raise ValueError(f"{where}: neither [[blocks]] of parameters nor a pass-through table")
    listed = names(params)
    twice = sorted({name for name in listed if listed.count(name) > 1})
    if twice:
        raise ValueError(f"{where}: listed twice: {', '.join(twice)}")
    return params


def _param(where: str, index: int, entry: Any) -> Param:
    try:
        return Param.model_validate(entry)
    except ValidationError as error:
        name = entry.get("name") if isinstance(entry, dict) else None
        raise ValueError(f"{where} parameter {name or index + 1}: {_reasons(error)}") from error


def _used(
    where: str, index: int, entry: dict[str, Any], groups: dict[str, tuple[Param, ...]]
) -> tuple[Param, ...]:
    """A group's parameters, with the kind's own defaults and descriptions."""
    try:
        use = Use.model_validate(entry)
    except ValidationError as error:
        raise ValueError(f"{where} block {index + 1}: {_reasons(error)}") from error
    if use.use not in groups:
        known = ", ".join(groups) or "none"
        raise ValueError(f"{where} block {index + 1}: no group {use.use!r} (known: {known})")
    params = groups[use.use]
    unknown = sorted((set(use.defaults) | set(use.descriptions)) - set(names(params)))
    if unknown:
        raise ValueError(f"{where}: group {use.use} has no parameter {', '.join(unknown)}")
    return tuple(
        param.model_copy(
            update={
                "default": use.defaults.get(param.name, param.default),
                "description": use.descriptions.get(param.name, param.description),
            }
        )
        for param in params
    )


def _pass_through(where: str, table: dict[str, Any]) -> tuple[Param, ...]:
    try:
        group = PassThrough.model_validate(table)
    except ValidationError as error:
        raise ValueError(f"{where}: {_reasons(error)}") from error
    unlisted = sorted(set(group.defaults) - set(group.names))
    if unlisted:
        raise ValueError(f"{where}: defaults for names it does not list: {', '.join(unlisted)}")
    return group.params()


def _reasons(error: ValidationError) -> str:
    """What pydantic found, one `field: problem (got value)` a field, without its links."""
    return "; ".join(
        f"{'.'.join(map(str, found['loc'])) or 'entry'}: {found['msg']}"
        + ("" if found["type"] == "missing" else f" (got {found['input']!r})")
        for found in error.errors()
    )


def _named(params: tuple[Param, ...], name: str) -> Param:
    """The parameter code reads a value of (a ValueError at import if the file lost it)."""
    for param in params:
        if param.name == name:
            return param
    raise ValueError(f"{CATALOG_FILE}: no parameter {name}")


def maximum(params: tuple[Param, ...], name: str) -> float | None:
    """The catalog's bound on a numeric parameter (None: none)."""
    return _named(params, name).maximum


def _default(params: tuple[Param, ...], name: str) -> str:
    default = _named(params, name).default
    if default is None:
        raise ValueError(f"{CATALOG_FILE}: {name} has no default")
    return default


_CATALOG = load(resources.files("coordinator.jobs").joinpath(CATALOG_FILE).read_text("utf-8"))

NOOP = _CATALOG["noop"]
STEPS = _CATALOG["steps"]
MNIST = _CATALOG["mnist"]
XGBOOST = _CATALOG["xgboost"]  # where the data is and how the job runs
XGBOOST_BOOSTER = _CATALOG["xgboost_booster"]  # passed through to XGBoost as given
COMMAND = _CATALOG["command"]

# Values code needs, read from the catalog so it stays their one source.
METHODS = _named(STEPS, "method").choices  # the step barrier's methods
XGBOOST_DEFAULT_DATA = _default(XGBOOST, "data")
COMMAND_GRACE = float(_default(COMMAND, "grace_seconds"))
