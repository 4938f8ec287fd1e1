"""The `coordinator` command: `worker` (one member), `run` (a whole job locally), `etcd`."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from enum import Enum
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from coordinator.etcd.server import EmbeddedEtcd
from coordinator.jobs import JOB_KINDS
from coordinator.jobs.params import parse_params
from coordinator.launchers.local import LocalLauncher, LocalWorker
from coordinator.rendezvous.address import ADVERTISE_ENV
from coordinator.worker import EXIT_CODES, EXIT_INTERRUPTED, WorkerOptions, run_worker

app = typer.Typer(
    help="Containers that find each other through etcd and train together.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

JobKind = Enum("JobKind", {name: name for name in JOB_KINDS}, type=str)  # type: ignore[misc]

PHASES = ["leader_election", "ip_exchange", "connect", "training", "cleaner"]

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


@app.command()
def worker(
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
    kind: Annotated[JobKind, typer.Option(envvar="COORDINATOR_KIND", help="job kind")] = "noop",  # type: ignore[assignment]
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
    """Run one member of a job: the entrypoint of a worker container."""
    try:
        params = parse_params(param or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--param") from None
    code = run_worker(
        WorkerOptions(
            job_id=job,
            world_size=world_size,
            etcd=etcd,
            kind=kind.value,
            namespace=namespace,
            ttl=ttl,
            timeout=timeout,
            connect_timeout=connect_timeout,
            advertise_address=advertise_address,
            port=port,
            params=params,
        )
    )
    # Everything the member owns is closed by now. Leave without the interpreter's
    # teardown: native threads (gRPC's, PyTorch's) still winding down can make it abort
    # ("terminate called without an active exception"), which would hide the exit code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def _etcd_endpoint(etcd: str | None) -> Iterator[str]:
    """The given endpoints, or an embedded etcd for the duration of the block."""
    if etcd:
        yield etcd
        return
    with EmbeddedEtcd() as server:
        console.print(f"[dim]embedded etcd at {server.endpoint} (data in {server.data_dir})[/dim]")
        yield server.endpoint


@app.command()
def run(
    kind: Annotated[JobKind, typer.Argument(help="job kind")],
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
    """Run a whole job with local worker processes (and an embedded etcd unless --etcd)."""
    job_id = job or f"{kind.value}-{uuid.uuid4().hex[:8]}"
    shortcuts = {"data": data, "rounds": rounds, "epochs": epochs, "method": method}
    param = [*(param or []), *(f"{k}={v}" for k, v in shortcuts.items() if v is not None)]
    # The launcher stops its workers itself; a terminal's Ctrl-C must not kill them first.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with _etcd_endpoint(etcd) as endpoint:
            args = [
                "--job", job_id, "--world-size", str(workers), "--etcd", endpoint,
                "--kind", kind.value, "--namespace", namespace, "--ttl", str(ttl),
                "--timeout", str(timeout), "--connect-timeout", str(connect_timeout),
                *(arg for p in param or [] for arg in ("--param", p)),
            ]  # fmt: skip
            console.print(f"job [bold]{job_id}[/bold]: {workers} {kind.value} workers")
            launcher = LocalLauncher(workers, args)
            try:
                _follow(
                    launcher,
                    deadline=time.monotonic() + timeout * (len(PHASES) + 1) + connect_timeout,
                )
            except KeyboardInterrupt:
                console.print("[yellow]interrupted: stopping workers[/yellow]")
                launcher.stop()
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
            if event["event"] == "phase" and event["phase"] in tasks:
                progress.advance(tasks[event["phase"]])
            elif event["event"] == "round" and event.get("rank") == 0:  # boosting rounds
                if "rounds" not in tasks:
                    tasks["rounds"] = progress.add_task("boosting rounds", total=event["rounds"])
                metrics = "  ".join(f"{k} {v:.4f}" for k, v in event["metrics"].items())
                progress.update(
                    tasks["rounds"], completed=event["round"], description=f"round {metrics}"
                )
            elif event["event"] in ("step", "metrics"):  # the mnist job's trainers and server
                _follow_steps(progress, tasks, event, clocks)


def _follow_steps(
    progress: Progress, tasks: dict[str, TaskID], event: dict, clocks: dict[int, tuple[int, int]]
) -> None:
    """One bar for all trainers' steps, titled with the latest test accuracy."""
    if "steps" not in tasks:
        tasks["steps"] = progress.add_task("training steps", total=None)
    if event["event"] == "step":
        clocks[event["rank"]] = (event["clock"], event["target"])
        progress.update(
            tasks["steps"],
            completed=sum(clock for clock, _ in clocks.values()),
            total=sum(target for _, target in clocks.values()),
        )
    else:
        progress.update(tasks["steps"], description=f"steps, test accuracy {event['accuracy']:.4f}")


def _report(workers: list[LocalWorker]) -> int:
    done = [w for w in workers if w.exit_code == 0 and w.done]
    if done:
        roster = done[0].done["roster"]  # type: ignore[index]
        table = Table(title=f"roster of job {roster['job_id']} (round {roster['round']})")
        for column in ("rank", "address", "hostname", "pid"):
            table.add_column(column)
        for member in roster["members"]:
            table.add_row(
                str(member["rank"]),
                f"{member['host']}:{member['port']}",
                member["hostname"],
                str(member["pid"]),
            )
        console.print(table)
        for worker in done:
            result = worker.done["result"]  # type: ignore[index]
            if "model_path" in result:
                metrics = ", ".join(f"{k} {v:.4f}" for k, v in result["metrics"].items())
                console.print(f"model: [bold]{result['model_path']}[/bold] ({metrics})")
    failed = [w for w in workers if w.exit_code != 0]
    for w in failed:
        reason = w.failed["message"] if w.failed else (w.stderr[-1] if w.stderr else "no output")
        console.print(f"[red]worker {w.index} (rank {w.rank}) exited {w.exit_code}:[/red] {reason}")
    if failed:
        return next(w.exit_code for w in failed if w.exit_code is not None) or 1
    console.print(f"[green]all {len(workers)} workers passed every phase and cleaned up[/green]")
    return 0


@app.command("etcd")
def etcd_server() -> None:
    """Run an embedded etcd on a free loopback port until Ctrl-C (for trying `worker`)."""
    with EmbeddedEtcd() as server:
        console.print(f"etcd listening at [bold]{server.endpoint}[/bold]; Ctrl-C stops it")
        print(server.endpoint, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


@app.command("exit-codes")
def exit_codes() -> None:
    """List the worker's exit codes and what each means."""
    for code, meaning in EXIT_CODES.items():
        print(f"{code:>4}  {meaning}")


@app.command("k8s")
def k8s_manifests(
    workers: Annotated[int, typer.Option(help="number of workers N (pods of the Indexed Job)")],
    job: Annotated[str, typer.Option(help="job id shared by the members")],
    image: Annotated[str, typer.Option(help="worker image")] = "etcd-coordinator:latest",
    etcd: Annotated[
        str | None,
        typer.Option(
            "--etcd",
            help="external etcd HOST:PORT[,...]; leaves the bundled etcd out [bundled]",
            show_default=False,
        ),
    ] = None,
    kind: Annotated[JobKind, typer.Option(help="job kind")] = "noop",  # type: ignore[assignment]
    namespace: Annotated[str, typer.Option(help="key prefix of this deployment")] = "/coordinator",
    param: Annotated[
        list[str] | None, typer.Option(help="job parameter KEY=VALUE (repeat, or comma-separate)")
    ] = None,
) -> None:
    """Print Kubernetes manifests for one job: `coordinator k8s ... | kubectl apply -f -`."""
    # Imported here: the manifests are only needed by this command.
    from coordinator.deploy import k8s as k8s_deploy

    try:
        docs = k8s_deploy.render(
            workers=workers,
            job=job,
            image=image,
            etcd=etcd,
            namespace_prefix=namespace,
            kind=kind.value,
            params=",".join(f"{k}={v}" for k, v in parse_params(param or []).items()),
        )
    except k8s_deploy.InvalidValue as exc:
        raise typer.BadParameter(str(exc), param_hint=f"--{exc.field}") from None
    except ValueError as exc:  # a parameter that is not KEY=VALUE
        raise typer.BadParameter(str(exc), param_hint="--param") from None
    except FileNotFoundError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    print(k8s_deploy.dump(docs), end="")


@app.command("simulate")
def simulate_barriers(
    workers: Annotated[int, typer.Option(min=1, help="number of virtual workers P")] = 200,
    seconds: Annotated[float, typer.Option(min=0, help="simulated duration in seconds")] = 200.0,
    barrier: Annotated[
        str,
        typer.Option(
            help="method(s), comma-separated: bsp, asp, ssp[:S], pbsp[:BETA], pssp[:S:BETA], "
            "dssp[:S_L:S_U]; bare names take --staleness/--sample/--staleness-upper"
        ),
    ] = "pssp",
    staleness: Annotated[
        int | None, typer.Option(min=0, help="s for ssp/pssp, S_L for dssp", show_default=False)
    ] = None,
    sample: Annotated[
        int | None, typer.Option(min=0, help="beta for pbsp/pssp", show_default=False)
    ] = None,
    staleness_upper: Annotated[
        int | None, typer.Option(min=0, help="S_U for dssp", show_default=False)
    ] = None,
    delay: Annotated[
        str,
        typer.Option(
            help="step durations: exp:SHIFT,MEAN | gamma:SHAPE,SCALE | "
            "straggler:FRACTION,FACTOR[,BASE] | trace:CSV"
        ),
    ] = "exp:1,1",
    seed: Annotated[int, typer.Option(help="seed of the delay and sampling streams")] = 0,
    sample_timing: Annotated[
        str, typer.Option(help="per-check (fresh sample at each check) or per-step (one per wait)")
    ] = "per-check",
    out: Annotated[str, typer.Option(help="directory for steps.csv and steps.png")] = ".",
) -> None:
    """Simulate P workers under barrier methods; write DIR/steps.csv and DIR/steps.png."""
    # Imported here: the simulator is not needed by the worker commands.
    import pathlib

    from coordinator.barriers.policy import SampleTiming
    from coordinator.simulator import engine, report
    from coordinator.simulator.delays import parse_delay
    from coordinator.simulator.spec import parse_barriers

    directory = pathlib.Path(out)

    try:
        specs = parse_barriers(barrier, staleness, sample, staleness_upper)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--barrier") from None
    try:
        model = parse_delay(delay)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--delay") from None
    try:
        timing = SampleTiming(sample_timing)
    except ValueError:
        raise typer.BadParameter(
            f"{sample_timing!r}: use per-check or per-step", param_hint="--sample-timing"
        ) from None
    directory.mkdir(parents=True, exist_ok=True)
    results = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} simulated s"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        for spec in specs:
            task = bar.add_task(str(spec), total=seconds or 1)
            results.append(
                engine.simulate(
                    spec,
                    workers,
                    seconds,
                    model,
                    seed=seed,
                    timing=timing,
                    progress=lambda t, task=task: bar.update(task, completed=t),
                )
            )
    report.write_csv(results, directory / "steps.csv")
    report.plot(
        results, directory / "steps.png", title=f"P={workers}, {seconds:g} s, delay {delay}"
    )
    table = Table(title=f"{workers} workers, {seconds:g} simulated s, delay {delay}, seed {seed}")
    for column in ("method", "mean step", "min", "max", "mean wait (s)", "max gap"):
        table.add_column(
            column, justify="left" if column == "method" else "right", no_wrap=column == "method"
        )
    for result in results:
        row = report.summary(result)
        table.add_row(*(str(value) for value in row.values()))
    Console().print(table)
    console.print(f"wrote {directory / 'steps.csv'} and {directory / 'steps.png'}")
