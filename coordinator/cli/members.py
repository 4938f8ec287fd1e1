"""The member commands: `worker` (one member) and `run` (a whole job with local workers;
what it shows is in `run_display`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from coordinator.cli.etcd_options import (
    DEFAULT_ETCD,
    EtcdOption,
    checked_security,
    with_etcd_security,
)
from coordinator.cli.options import (
    ConnectTimeoutOption,
    KindArgument,
    MemberKind,
    NamespaceOption,
    ParamOption,
    TimeoutOption,
    TtlOption,
    console,
    parse_param_option,
    program_after_dashes,
)
from coordinator.cli.run_display import PHASES, echo, follow, report
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
from coordinator.jobs import COMMAND, KINDS
from coordinator.jobs.private_folder import make_private_folder
from coordinator.jobs.threads import check_thread_caps, thread_cap
from coordinator.keys import job_path
from coordinator.launch import WorkerCommand
from coordinator.launch.piped import PipedLauncher
from coordinator.rendezvous.address import ADVERTISE_ENV
from coordinator.worker import EXIT_INTERRUPTED, WorkerOptions, run_worker


@with_etcd_security
def worker(
    ctx: typer.Context,
    etcd_settings: EtcdSecurity,  # the --etcd-* options, from `with_etcd_security`
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
    ] = DEFAULT_ETCD,
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
) -> None:
    """Run one member of a job: the entrypoint of a worker container.

    With `-- PROGRAM [ARGS...]` (kind command) the member runs that program once the
    rendezvous is done, with torch's env:// variables set (see docs/programs.md)."""
    program = program_after_dashes(ctx)
    kind_name = member_kind(kind.value if kind else None, program, default="noop")
    params = parse_param_option(param)
    # Exported into the environment, where the member's etcd client reads them.
    checked_security(etcd, etcd_settings)
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
    private = make_private_folder("run")  # (a killed run's goes as the next member starts)
    try:
        if etcd:
            with _job_user(etcd, namespace, job_id, security, private):
                yield etcd
            return
        with EmbeddedEtcd() as server:
            console.print(
                f"[dim]embedded etcd at {server.endpoint} (data in {server.data_dir})[/dim]"
            )
            with _job_user(server.endpoint, namespace, job_id, server.security, private):
                yield server.endpoint
    finally:
        shutil.rmtree(private, ignore_errors=True)


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


@with_etcd_security
def run(
    ctx: typer.Context,
    etcd_settings: EtcdSecurity,  # the --etcd-* options, from `with_etcd_security`
    kind: KindArgument = None,
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
) -> None:
    """Run a whole job with local worker processes (and an embedded etcd unless --etcd).

    `coordinator run --workers N -- PROGRAM [ARGS...]` runs your program as each member
    (kind command), torchrun-style: its output is shown prefixed with its rank."""
    program = program_after_dashes(ctx)
    kind_name = member_kind(kind.value if kind else None, program, default=None)
    # Checked here; the workers inherit the settings from the environment (a job user's,
    # see `_etcd_endpoint`). Without --etcd, the embedded etcd's own settings are used.
    security = checked_security(etcd, etcd_settings) if etcd else EtcdSecurity()
    job_id = job or f"{kind_name}-{uuid.uuid4().hex[:8]}"
    shortcuts = {"data": data, "rounds": rounds, "epochs": epochs, "method": method}
    param = [*(param or []), *(f"{k}={v}" for k, v in shortcuts.items() if v is not None)]
    params = parse_param_option(param)
    try:  # before anything starts: the workers would each refuse it
        check_thread_caps(kind_name, KINDS[kind_name].params, params, thread_cap())
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--param") from None
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
            launcher = PipedLauncher(workers, command, echo=kind_name == COMMAND)
            try:
                if kind_name == COMMAND:  # the programs' output, and no deadline on training
                    echo(launcher)
                else:
                    follow(
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
    raise typer.Exit(report(launcher.workers))
