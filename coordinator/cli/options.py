"""Shared pieces of the commands: the stderr console and its progress bars, option types
and --param parsing (the etcd options are in `etcd_options`)."""

from __future__ import annotations

import os
from enum import Enum
from typing import Annotated, Any

import typer
import typer.core
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from coordinator.jobs import JOB_KINDS, MEMBER_KINDS
from coordinator.jobs.params import parse_param_list, parse_params
from coordinator.jobs.threads import MAX_THREADS_ENV

console = Console(stderr=True)

#: What an unknown value shows as in a table (a member that never published its address).
NONE_YET = "-"


def folding_table(*headers: str, title: str | None = None, right: tuple[str, ...] = ()) -> Table:
    """A table whose cells wrap, and fold a long word (a job id) over lines, on a narrow
    terminal: it never cuts a value short. `right`: the columns of numbers."""
    columns = [
        Column(h, overflow="fold", justify="right" if h in right else "left") for h in headers
    ]
    return Table(*columns, title=title)


JobKind = Enum("JobKind", {name: name for name in JOB_KINDS}, type=str)  # type: ignore[misc]
#: The kinds of `worker` and `run`: the service's, and `command` (a program after --).
MemberKind = Enum("MemberKind", {name: name for name in MEMBER_KINDS}, type=str)  # type: ignore[misc]

PROGRAM_META = "coordinator.program"


class ProgramCommand(typer.core.TyperCommand):
    """A command that takes a program after `--`: everything after the first `--` is the
    program and its arguments, one list, never parsed as this command's options."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if "--" in args:
            at = args.index("--")
            ctx.meta[PROGRAM_META] = args[at + 1 :]
            args = args[:at]
        return super().parse_args(ctx, args)


def program_after_dashes(ctx: typer.Context) -> list[str] | None:
    """The program given after `--` to the running command (None: no `--`)."""
    program = ctx.meta.get(PROGRAM_META)
    return None if program is None else list(program)


def progress_bar(
    *counts: ProgressColumn, description: str = "{task.description}", transient: bool = False
) -> Progress:
    """A bar on the stderr console: the task's description, the bar, `counts`, the time."""
    return Progress(
        TextColumn(description), BarColumn(), *counts, TimeElapsedColumn(),
        console=console, transient=transient,
    )  # fmt: skip


def unset_option(value_type: type, envvar: str, help: str) -> Any:
    """The type of an option that may be left out (None: its help says what that means),
    also read from $`envvar`. It shows no default: None would say nothing."""
    return Annotated[value_type | None, typer.Option(envvar=envvar, help=help, show_default=False)]


KindArgument = Annotated[
    MemberKind | None,  # type: ignore[valid-type]
    typer.Argument(help="job kind [command when a program follows --]", show_default=False),
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
        help="job parameter KEY=VALUE, taken whole (repeat for more) "
        "[$COORDINATOR_PARAMS: KEY=VALUE,KEY=VALUE]",
        show_default=False,
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
    """The --param values as a dict, each one whole (a value's commas stay in it); without
    any, $COORDINATOR_PARAMS (comma-separated: a manifest's). Not KEY=VALUE: a bad --param."""
    try:
        if param:
            return parse_params(param)
        return parse_param_list(os.environ.get("COORDINATOR_PARAMS", ""))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--param") from None


def parse_labels(items: list[str] | None, option: str = "--label") -> dict[str, str]:
    """`--label KEY=VALUE` options as a dict; a malformed one is a usage error."""
    labels = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint=option)
        labels[key] = value
    return labels


def parse_env(items: list[str] | None) -> dict[str, str]:
    """`--env NAME=VALUE`, or `--env NAME` for this shell's value of NAME (so a secret
    need not be written in the command line, where `ps` shows it)."""
    env = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep:
            if name not in os.environ:
                raise typer.BadParameter(f"{name!r} is not set in this shell", param_hint="--env")
            value = os.environ[name]
        env[name] = value
    return env


#: `serve`'s and `agent`'s cap on a job's thread counts, which their members check again.
MaxThreadsOption = Annotated[
    int | None,
    typer.Option(
        envvar=MAX_THREADS_ENV,
        min=1,
        help="the most threads a job may ask per member (mnist threads, xgboost "
        "nthread) [the host's cores]",
        show_default=False,
    ),
]
#: `serve`'s and `agent`'s limit on each local member's processes and threads.
MemberPidsLimitOption = Annotated[
    int,
    typer.Option(
        envvar="COORDINATOR_MEMBER_PIDS_LIMIT",
        min=16,
        help="processes and threads of each local member (a pids cgroup of its own; "
        "RLIMIT_NPROC under a uid of its own)",
    ),
]
RunAsOption = Annotated[
    str | None,
    typer.Option(
        "--run-as-uids",
        envvar="COORDINATOR_RUN_AS_UIDS",
        help="FIRST-LAST: run each job's command programs under a uid of this range of its "
        "own, never ours (needs root) [programs run as this process's user]",
        show_default=False,
    ),
]


def run_as_range(text: str | None) -> range | None:
    """`--run-as-uids` checked: the range, or None when not given; exits 2 naming it."""
    from coordinator.jobs.run_as import parse_uid_range

    if not text:
        return None
    try:
        uids = parse_uid_range(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--run-as-uids") from None
    if os.geteuid() != 0:
        raise typer.BadParameter(
            "needs root (it starts programs as other users)", param_hint="--run-as-uids"
        )
    return uids
