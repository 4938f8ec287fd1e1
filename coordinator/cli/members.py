"""The member commands: `worker` (one member) and `run` (a whole job with local workers)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from coordinator.cli.options import (
    ConnectTimeoutOption,
    EtcdCaOption,
    EtcdCertOption,
    EtcdKeyOption,
    EtcdOption,
    EtcdPasswordFileOption,
    EtcdUserOption,
    MemberKind,
    NamespaceOption,
    ParamOption,
    TimeoutOption,
    TtlOption,
    console,
    etcd_security,
    parse_param_option,
    program_after_dashes,
)
from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.etcd.users import (
    CannotManageUsers,
    provision_job,
    revoke_job,
    write_password_file,
)
from coordinator.events import Metrics, Output, Phase, Report, Round, Step
from coordinator.jobs import COMMAND
from coordinator.keys import job_path
from coordinator.launch import WorkerCommand
from coordinator.launch.piped import LocalLauncher, LocalWorker
from coordinator.rendezvous.address import ADVERTISE_ENV
from coordinator.rendezvous.errors import MemberLost
from coordinator.worker import EXIT_INTERRUPTED, WorkerOptions, run_worker

PHASES = ["leader_election", "ip_exchange", "connect", "training", "cleaner"]


def worker(
    ctx: typer.Context,
    job: Annotated[
        str, typer.Option(envvar="COORDINATOR_JOB", help="job id shared by all members")
    ],
    world_size: Annotated[
        int, typer.Option(envvar="COORDINATOR_WORLD_SIZE", min=1, help="number of members N")
    ],
    etcd: Annotated[
        str,
        typer.Option(
            "--etcd", envvar="COORDINATOR_ETCD", help="etcd endpoints HOST:PORT[,HOST:PORT...]"
        ),
    ] = "127.0.0.1:2379",
    kind: Annotated[
        MemberKind | None,  # type: ignore[valid-type]
        typer.Option(
            envvar="COORDINATOR_KIND",
            help="job kind [command with a program after --, else noop]",
            show_default=False,
        ),
    ] = None,
    namespace: NamespaceOption = "/coordinator",
    ttl: TtlOption = 10,
    timeout: TimeoutOption = 300.0,
    connect_timeout: ConnectTimeoutOption = 10.0,
    advertise_address: Annotated[
        str | None,
        typer.Option(envvar=ADVERTISE_ENV, help="address the others reach this member at [auto]"),
    ] = None,
    port: Annotated[
        int,
        typer.Option(envvar="COORDINATOR_PORT", min=0, max=65535, help="endpoint port (0: any)"),
    ] = 0,
    param: ParamOption = None,
    etcd_ca: EtcdCaOption = None,
    etcd_cert: EtcdCertOption = None,
    etcd_key: EtcdKeyOption = None,
    etcd_user: EtcdUserOption = None,
    etcd_password_file: EtcdPasswordFileOption = None,
) -> None:
    """Run one member of a job: the entrypoint of a worker container.

    With `-- PROGRAM [ARGS...]` (kind command) the member runs that program once the
    rendezvous is done, with torch's env:// variables set (see the README)."""
    program = program_after_dashes(ctx)
    kind_name = member_kind(kind.value if kind else None, program, default="noop")
    params = parse_param_option(param)
    # Exported into the environment, where the member's etcd client reads them.
    etcd_security(etcd, etcd_ca, etcd_cert, etcd_key, etcd_user, etcd_password_file)
    code = run_worker(
        WorkerOptions(
            job_id=job,
            world_size=world_size,
            etcd=etcd,
            kind=kind_name,
            namespace=namespace,
            ttl=ttl,
            timeout=timeout,
            connect_timeout=connect_timeout,
            advertise_address=advertise_address,
            port=port,
            params=params,
            program=program if kind_name == COMMAND else None,
        )
    )
    # Everything the member owns is closed by now. Leave without the interpreter's
    # teardown: native threads (gRPC's, PyTorch's) still winding down can make it abort
    # ("terminate called without an active exception"), which would hide the exit code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def member_kind(given: str | None, program: list[str] | None, default: str | None) -> str:
    """The kind a `worker` or `run` runs: `command` when a program follows `--` (which no
    other kind takes), else the kind given, else `default` (None: the kind is required)."""
    if program is not None:
        if given not in (None, COMMAND):
            raise typer.BadParameter(
                f"a program after -- runs as kind {COMMAND}, not {given}", param_hint="kind"
            )
        return COMMAND
    if given is None:
        if default is None:
            raise typer.BadParameter(
                "give a job kind, or a program after -- (coordinator run -- PROGRAM ARGS)",
                param_hint="KIND",
            )
        return default
    return given


@contextlib.contextmanager
def _etcd_endpoint(
    etcd: str | None, namespace: str, job_id: str, security: EtcdSecurity
) -> Iterator[str]:
    """The given endpoints, or an embedded etcd (auth on), for the duration of the block;
    the workers' etcd settings exported for them to inherit: a user of the job's own
    when the settings may make one, else the settings as given."""
    with tempfile.TemporaryDirectory(prefix="coordinator-run-") as private:  # 0700
        if etcd:
            with _job_user(etcd, namespace, job_id, security, Path(private)):
                yield etcd
            return
        with EmbeddedEtcd() as server:
            console.print(
                f"[dim]embedded etcd at {server.endpoint} (data in {server.data_dir})[/dim]"
            )
            with _job_user(server.endpoint, namespace, job_id, server.security, Path(private)):
                yield server.endpoint


@contextlib.contextmanager
def _job_user(
    endpoint: str, namespace: str, job_id: str, security: EtcdSecurity, private: Path
) -> Iterator[None]:
    """Export a job user's settings while the block runs, and remove the user after it
    (nothing when etcd has no auth, or `security`'s user may not make users)."""
    try:
        admin = Etcd(endpoint, namespace=namespace, security=security, probe=job_path(job_id))
    except EtcdError:  # the workers will say what is wrong, each as it connects
        security.export()
        yield
        return
    try:
        credentials = provision_job(admin, job_id) if admin.auth_enabled() else None
    except CannotManageUsers as exc:
        console.print(f"[yellow]workers connect as {security.user}: {exc}[/yellow]")
        credentials = None
    except ValueError:  # not a job id: each worker names the problem
        credentials = None
    if credentials is None:
        admin.close()
        security.export()
        yield
        return
    password_file = write_password_file(private / "job.password", credentials.password)
    replace(security, user=credentials.user, password_file=str(password_file)).export()
    try:
        yield
    finally:
        with contextlib.suppress(EtcdError):
            revoke_job(admin, job_id)
        admin.close()
        security.export()


def run(
    ctx: typer.Context,
    kind: Annotated[
        MemberKind | None,  # type: ignore[valid-type]
        typer.Argument(help="job kind [command when a program follows --]", show_default=False),
    ] = None,
    workers: Annotated[int, typer.Option(min=1, help="number of local worker processes")] = 2,
    etcd: EtcdOption = None,
    job: Annotated[str | None, typer.Option(help="job id [random]")] = None,
    namespace: NamespaceOption = "/coordinator",
    ttl: TtlOption = 10,
    timeout: TimeoutOption = 300.0,
    connect_timeout: ConnectTimeoutOption = 10.0,
    param: ParamOption = None,
    data: Annotated[
        str | None,
        typer.Option(
            help="training data: xgboost: path/glob, synthetic:ROWSxFEATURES, builtin; "
            "mnist: digits (builtin) or a directory of MNIST IDX files"
        ),
    ] = None,
    rounds: Annotated[int | None, typer.Option(min=1, help="boosting rounds (xgboost)")] = None,
    epochs: Annotated[
        int | None, typer.Option(min=1, help="passes over each trainer's shard (mnist)")
    ] = None,
    method: Annotated[
        str | None, typer.Option(help="step barrier (steps, mnist): bsp|ssp|asp|pbsp|pssp|dssp")
    ] = None,
    etcd_ca: EtcdCaOption = None,
    etcd_cert: EtcdCertOption = None,
    etcd_key: EtcdKeyOption = None,
    etcd_user: EtcdUserOption = None,
    etcd_password_file: EtcdPasswordFileOption = None,
) -> None:
    """Run a whole job with local worker processes (and an embedded etcd unless --etcd).

    `coordinator run --workers N -- PROGRAM [ARGS...]` runs your program as each member
    (kind command), torchrun-style: its output is shown prefixed with its rank."""
    program = program_after_dashes(ctx)
    kind_name = member_kind(kind.value if kind else None, program, default=None)
    # Checked here; the workers inherit the settings from the environment (a job user's,
    # see `_etcd_endpoint`; the embedded etcd takes no TLS settings, so those need --etcd).
    security = etcd_security(
        etcd or "127.0.0.1:2379", etcd_ca, etcd_cert, etcd_key, etcd_user, etcd_password_file
    )
    job_id = job or f"{kind_name}-{uuid.uuid4().hex[:8]}"
    shortcuts = {"data": data, "rounds": rounds, "epochs": epochs, "method": method}
    param = [*(param or []), *(f"{k}={v}" for k, v in shortcuts.items() if v is not None)]
    params = parse_param_option(param)
    # The launcher stops its workers itself; a terminal's Ctrl-C must not kill them first.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with _etcd_endpoint(etcd, namespace, job_id, security) as endpoint:
            command = WorkerCommand(
                job_id=job_id,
                world_size=workers,
                etcd=endpoint,
                kind=kind_name,
                namespace=namespace,
                ttl=ttl,
                timeout=timeout,
                connect_timeout=connect_timeout,
                params=params,
                program=tuple(program or ()) if kind_name == COMMAND else None,  # as given
            )
            console.print(f"job [bold]{job_id}[/bold]: {workers} {kind_name} workers")
            launcher = LocalLauncher(workers, command, echo=kind_name == COMMAND)
            try:
                if kind_name == COMMAND:  # the programs' output, and no deadline on training
                    _echo(launcher)
                else:
                    _follow(
                        launcher,
                        deadline=time.monotonic() + timeout * (len(PHASES) + 1) + connect_timeout,
                    )
            except KeyboardInterrupt:
                console.print("[yellow]interrupted: stopping workers[/yellow]")
                raise typer.Exit(EXIT_INTERRUPTED) from None
            finally:
                launcher.stop()
    finally:
        signal.signal(signal.SIGTERM, previous)
    raise typer.Exit(_report(launcher.workers))


def _follow(launcher: LocalLauncher, deadline: float) -> None:
    columns = (
        TextColumn("{task.description:<16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    n = len(launcher.workers)
    with Progress(*columns, console=console, transient=False) as progress:
        tasks = {phase: progress.add_task(phase, total=n) for phase in PHASES}
        clocks: dict[int, tuple[int, int]] = {}  # trainer rank -> (clock, target)
        while launcher.running() or not launcher.events.empty():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                console.print("[red]workers overran their deadline: stopping them[/red]")
                return
            try:
                _, event = launcher.events.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if isinstance(event, Phase) and event.phase in tasks:
                progress.advance(tasks[event.phase])
            elif isinstance(event, Round) and event.rank == 0:  # boosting rounds
                if "rounds" not in tasks:
                    tasks["rounds"] = progress.add_task("boosting rounds", total=event.rounds)
                metrics = "  ".join(f"{k} {v:.4f}" for k, v in event.metrics.items())
                progress.update(
                    tasks["rounds"], completed=event.round, description=f"round {metrics}"
                )
            elif isinstance(event, Step | Metrics):  # the mnist job's trainers and server
                _follow_steps(progress, tasks, event, clocks)


def _echo(launcher: LocalLauncher) -> None:
    """Show the programs' output lines, each prefixed with its rank, as they come, and
    their reports as one bar: every rank's latest step of its total, and the latest
    metrics. Report lines are printed too where the output is not a terminal (a log)."""
    reports: dict[int, Report] = {}  # rank -> its latest report
    lines = not sys.stdout.isatty()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=False) as progress:
        task: TaskID | None = None
        while launcher.running() or not launcher.events.empty():
            try:
                index, event = launcher.events.get(timeout=0.5)
            except queue.Empty:
                continue
            rank = launcher.workers[index].rank
            if isinstance(event, Output) or (isinstance(event, Report) and lines):
                stream = sys.stderr if getattr(event, "stream", "") == "stderr" else sys.stdout
                line = event.line if isinstance(event, Output) else event.to_line()
                print(f"[rank {'?' if rank is None else rank}] {line}", file=stream, flush=True)
            if isinstance(event, Report) and event.step is not None:
                reports[event.rank if event.rank is not None else -1] = event
                if task is None:
                    task = progress.add_task("steps", total=None)
                totals = [r.total for r in reports.values()]
                metrics = "  ".join(f"{k} {v:.4g}" for k, v in event.metrics.items())
                progress.update(
                    task,
                    completed=sum(r.step or 0 for r in reports.values()),
                    total=None if None in totals else sum(t or 0 for t in totals),
                    description=f"steps  {metrics}".strip(),
                )


def _follow_steps(
    progress: Progress,
    tasks: dict[str, TaskID],
    event: Step | Metrics,
    clocks: dict[int, tuple[int, int]],
) -> None:
    """One bar for all trainers' steps, titled with the latest test accuracy."""
    if "steps" not in tasks:
        tasks["steps"] = progress.add_task("training steps", total=None)
    if isinstance(event, Step):
        clocks[event.rank] = (event.clock, event.target)
        progress.update(
            tasks["steps"],
            completed=sum(clock for clock, _ in clocks.values()),
            total=sum(target for _, target in clocks.values()),
        )
    elif event.accuracy is not None:
        progress.update(tasks["steps"], description=f"steps, test accuracy {event.accuracy:.4f}")


def _report(workers: list[LocalWorker]) -> int:
    done = [(w, w.done) for w in workers if w.exit_code == 0 and w.done]
    if done:
        roster = done[0][1].roster
        table = Table(title=f"roster of job {roster.job_id} (round {roster.round})")
        for column in ("rank", "address", "hostname", "pid"):
            table.add_column(column)
        for member in roster.members:
            table.add_row(
                str(member.rank), f"{member.host}:{member.port}", member.hostname, str(member.pid)
            )
        console.print(table)
        for _, event in done:
            result = event.result
            if "model_path" in result:
                metrics = ", ".join(f"{k} {v:.4f}" for k, v in result["metrics"].items())
                console.print(f"model: [bold]{result['model_path']}[/bold] ({metrics})")
    failed = [w for w in workers if w.exit_code != 0]
    for w in failed:
        reason = w.failed.message if w.failed else (w.stderr[-1] if w.stderr else "no output")
        console.print(
            f"[red]worker {w.index} (rank {w.rank}) exited {w.exit_code}:[/red] {escape(reason)}"
        )
    if failed:
        return run_exit_code([w.exit_code for w in failed])
    console.print(f"[green]all {len(workers)} workers passed every phase and cleaned up[/green]")
    return 0


def run_exit_code(failed: list[int | None]) -> int:
    """The run's exit code from its failed workers' codes: the first cause's, not a
    survivor's `MemberLost` (which only says someone else failed first)."""
    causes = [code for code in failed if code not in (None, MemberLost.exit_code)]
    return next(iter(causes), None) or next((c for c in failed if c), None) or 1
