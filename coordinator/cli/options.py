"""Shared pieces of the commands: the stderr console, option types and --param parsing."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer
from rich.console import Console

from coordinator.jobs import JOB_KINDS
from coordinator.jobs.params import parse_params

console = Console(stderr=True)

JobKind = Enum("JobKind", {name: name for name in JOB_KINDS}, type=str)  # type: ignore[misc]

EtcdOption = Annotated[
    str | None,
    typer.Option(
        "--etcd",
        envvar="COORDINATOR_ETCD",
        help="etcd endpoints HOST:PORT[,HOST:PORT...]",
        show_default=False,
    ),
]
NamespaceOption = Annotated[
    str, typer.Option(envvar="COORDINATOR_NAMESPACE", help="key prefix of this deployment")
]
TtlOption = Annotated[
    int,
    typer.Option(
        envvar="COORDINATOR_TTL",
        min=2,
        help="lease TTL in seconds: a dead member is noticed within it",
    ),
]
TimeoutOption = Annotated[
    float,
    typer.Option(
        envvar="COORDINATOR_TIMEOUT", min=0.1, help="deadline of each phase's wait, in seconds"
    ),
]
ParamOption = Annotated[
    list[str] | None,
    typer.Option(
        envvar="COORDINATOR_PARAMS", help="job parameter KEY=VALUE (repeat, or comma-separate)"
    ),
]
ConnectTimeoutOption = Annotated[
    float,
    typer.Option(
        envvar="COORDINATOR_CONNECT_TIMEOUT",
        min=0.1,
        help="give up on reaching etcd after this many seconds",
    ),
]


def parse_param_option(param: list[str] | None) -> dict[str, str]:
    """The --param values as a dict; a value that is not KEY=VALUE is a bad --param."""
    try:
        return parse_params(param or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--param") from None


def parse_labels(items: list[str] | None) -> dict[str, str]:
    """`--label KEY=VALUE` options as a dict; a malformed one is a usage error."""
    labels = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint="--label")
        labels[key] = value
    return labels
