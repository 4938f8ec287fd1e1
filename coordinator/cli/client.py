"""The REST client commands: submit, jobs, status, events, logs, cancel, on
`coordinator.client` (which says how the token is found).

Exit codes mirror the job: 0 SUCCEEDED (or still live, for `status`), 1
FAILED, 130 CANCELLED; 2 a request the service refused (its message is
printed), 3 the service could not be reached.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from coordinator.cli.members import member_kind
from coordinator.cli.options import (
    NONE_YET,
    KindArgument,
    ParamOption,
    folding_table,
    parse_env,
    parse_labels,
    parse_param_option,
    program_after_dashes,
    unset_option,
)
from coordinator.exit_codes import EXIT_ETCD_UNAVAILABLE

if TYPE_CHECKING:  # imported when a command calls the service: members need no httpx
    from coordinator.client import Client

out = Console()
err = Console(stderr=True)

ServerOption = Annotated[
    str | None,
    typer.Option(envvar="COORDINATOR_SERVER", help="the service's URL [http://127.0.0.1:8080]"),
]
TokenOption = unset_option(
    str, "COORDINATOR_TOKEN", "bearer token [a local service's DATA_DIR/api-token]"
)
JobIdArgument = Annotated[str, typer.Argument(help="job id")]
OUTCOME_CODES = {"SUCCEEDED": 0, "FAILED": 1, "CANCELLED": 130}


@contextlib.contextmanager
def service(server: str | None, token: str | None) -> Iterator[Client]:
    """A client of the service; what it raises ends the command with its message and
    exit code (3 unreachable, 1 the service's fault, 2 any refusal)."""
    from coordinator.client import Client, ServiceError, ServiceFailed, Unreachable

    try:
        with Client(server, token) as client:
            yield client
    except Unreachable as exc:
        err.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(EXIT_ETCD_UNAVAILABLE) from None
    except (ServiceError, ValueError) as exc:  # ValueError: a token file we may not use
        err.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(1 if isinstance(exc, ServiceFailed) else 2) from None


def submit(
    ctx: typer.Context,
    kind: KindArgument = None,
    workers: Annotated[int, typer.Option(min=1, help="number of members")] = 2,
    param: ParamOption = None,
    job_id: Annotated[str | None, typer.Option("--id", help="job id [generated]")] = None,
    max_restarts: Annotated[int, typer.Option(min=0)] = 0,
    deadline: Annotated[float | None, typer.Option(help="seconds before it fails")] = None,
    priority: int = 0,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE (repeat)")] = None,
    launcher: Annotated[
        str | None, typer.Option(help="local, docker, agents or kubernetes [the service's]")
    ] = None,
    agent_selector: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE an agent must carry (repeat)")
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option(
            help="command jobs: NAME=VALUE, or NAME for this shell's value, in the program's "
            "environment (repeat)"
        ),
    ] = None,
    working_dir: Annotated[
        str | None,
        typer.Option(help="command jobs: the program's folder, under the service's root"),
    ] = None,
    wait: Annotated[bool, typer.Option(help="follow the job to its end")] = False,
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """Submit a job (safe to retry with the same --id).

    `coordinator submit --workers N -- PROGRAM [ARGS...]` submits your program as a
    `command` job (an exec token's right)."""
    program = program_after_dashes(ctx)
    kind_name = member_kind(kind.value if kind else None, program, default=None)
    spec: dict[str, Any] = {
        "kind": kind_name,
        "workers": workers,
        "params": parse_param_option(param),
        "max_restarts": max_restarts,
        "priority": priority,
        "labels": parse_labels(label),
        "agent_selector": parse_labels(agent_selector),
    }
    if program is not None:
        spec["command"] = program
    if env:
        spec["env"] = parse_env(env)
    if working_dir:
        spec["working_dir"] = working_dir
    if launcher:
        spec["launcher"] = launcher
    if job_id:
        spec["id"] = job_id
    if deadline is not None:
        spec["deadline_seconds"] = deadline
    with service(server, token) as client:
        record = client.submit(spec)
        out.print(f"{record.id}: {record.state}")
        code = _follow(client, record.id) if wait else None
    if code is not None:
        raise typer.Exit(code)


def _follow(client: Client, job_id: str) -> int:
    """Show the job's progress until its final state; the exit code it mirrors."""
    state = "PENDING"
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}")]  # fmt: skip
    with Progress(*columns, TimeElapsedColumn(), console=err) as progress:
        task = progress.add_task(job_id, total=None, info="")
        for record in client.events(job_id):
            state = record.state
            done = record.progress
            reason = record.conditions[-1].reason if record.conditions else ""
            metrics = "  ".join(
                f"{name} {value:.4g}"
                for name, value in done.metrics.items()
                if isinstance(value, int | float) and not isinstance(value, bool)
            )
            progress.update(
                task,
                total=done.total,
                completed=done.step or 0,
                info=f"{state}: {metrics or reason}"[:50],  # the bar must fit 80 columns
            )
    out.print(f"{job_id}: {state}")
    return OUTCOME_CODES.get(state, 0)


def jobs(
    state: Annotated[str | None, typer.Option(help="only jobs in this state")] = None,
    kind: Annotated[str | None, typer.Option(help="only jobs of this kind")] = None,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE (repeat)")] = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many")] = 100,
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """List jobs, in id order."""
    table = folding_table("id", "kind", "workers", "state", "since", "reason")
    with service(server, token) as client:
        found = client.jobs(state, kind, parse_labels(label), page_size=min(500, limit))
        for _, record in zip(range(limit), found, strict=False):
            last = record.conditions[-1]
            since = time.strftime("%H:%M:%S", time.localtime(last.at))
            table.add_row(
                record.id, record.spec.kind, str(record.spec.workers),
                record.state, since, last.reason[:300],
            )  # fmt: skip
    out.print(table)


def status(job_id: JobIdArgument, server: ServerOption = None, token: TokenOption = None) -> None:
    """A job's state, history, members, progress and artifacts."""
    with service(server, token) as client:
        record = client.get(job_id)
    spec = record.spec
    out.print(f"[bold]{record.id}[/bold]  {spec.kind} x{spec.workers}  {record.state}")
    history = folding_table("state", "at", "reason", title="history")
    for condition in record.conditions:
        at = time.strftime("%H:%M:%S", time.localtime(condition.at))
        history.add_row(condition.state, at, condition.reason)
    out.print(history)
    if record.attempts:
        attempt = record.attempts[-1]
        title = f"attempt {attempt.number}"
        members = folding_table("rank", "address", "phase", "exit", "failure", title=title)
        for member in attempt.members:
            failure = member.failure or {}
            members.add_row(
                NONE_YET if member.rank is None else str(member.rank), member.address or NONE_YET,
                member.phase, "" if member.exit_code is None else str(member.exit_code),
                str(failure.get("message", ""))[:80],
            )  # fmt: skip
        out.print(members)
    progress = record.progress
    if progress.step is not None:
        out.print(f"progress: {progress.step}/{progress.total}  {progress.metrics}")
    for name, path in record.artifacts.items():
        out.print(f"{name}: {path}")
    raise typer.Exit(OUTCOME_CODES.get(record.state, 0))


def events(job_id: JobIdArgument, server: ServerOption = None, token: TokenOption = None) -> None:
    """Follow a job's changes (one line each) until its final state."""
    state = "PENDING"
    with service(server, token) as client:
        for record in client.events(job_id):
            state = record.state
            progress = record.progress
            step = f" {progress.step}/{progress.total}" if progress.step else ""
            out.print(f"{state}{step}  {record.conditions[-1].reason}")
    raise typer.Exit(OUTCOME_CODES.get(state, 0))


def logs(
    job_id: JobIdArgument,
    rank: Annotated[int | None, typer.Option(help="only this member")] = None,
    tail: Annotated[int | None, typer.Option(help="only the last N lines")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="until the members end")] = False,
    events: Annotated[
        bool, typer.Option("--events", help="your program's members' own events too")
    ] = False,
    server: ServerOption = None,
    token: TokenOption = None,
) -> None:
    """The members' output, each line prefixed with its rank (for your own program, its
    lines alone, without its members' events unless --events)."""
    with service(server, token) as client:
        for line in client.logs(job_id, rank, tail, follow, events):
            out.out(line, highlight=False)


def cancel(job_id: JobIdArgument, server: ServerOption = None, token: TokenOption = None) -> None:
    """Cancel a job (idempotent); its members leave, then it is CANCELLED."""
    with service(server, token) as client:
        record = client.cancel(job_id)
    requested = "" if record.state.terminal else " (cancel requested)"
    out.print(f"{record.id}: {record.state}{requested}")
