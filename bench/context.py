"""A step-barrier check from user code (`ctx.steps(...)`) against the built-in `steps` job's.

P members are separate processes against an embedded etcd on loopback, as in
bench/barriers.py. Each rendezvouses once (`Member`, as a `steps` job's member
does), then alternates, `--repeat` times each, over the same steps with no compute:

- built-in: `LiveBarrier` on the member itself (`wait_turn` + `complete`), as
  coordinator/jobs/steps.py runs it;
- user code: `coordinator.context()` built from the environment a `command`
  job gives its program (a roster file, the member's lease and round) with a
  client of its own, then `steps.wait(c)` + `steps.done(c + 1)`: the program's
  `AttachedMember`, keys on the borrowed lease, the same decision code.

A named barrier lines all members up before each run. Per run: wall seconds per
step (the job's: first start to last end, over the steps) and CPU seconds per
check (each member's own process time over its steps, mean over members). The
ratio user/built-in is of the medians, in the same run.

    python bench/context.py                               # P = 4, 16; every method
    python bench/context.py --sizes 4 --methods bsp,ssp --steps 100 --repeat 3
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.barriers.live import LiveBarrier
from coordinator.barriers.policy import BarrierSpec
from coordinator.context import Context
from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.program_steps import check_steps
from coordinator.rendezvous.member import Member

console = Console(width=150)
JOB = "bench"


def method_args(name: str, beta: int) -> dict[str, Any]:
    """`ctx.steps` arguments of each method (staleness 1, DSSP up to 3, sample `beta`)."""
    known: dict[str, dict[str, Any]] = {
        "bsp": {},
        "ssp": {"staleness": 1},
        "asp": {},
        "pbsp": {"sample": beta},
        "pssp": {"staleness": 1, "sample": beta},
        "dssp": {"staleness": 1, "staleness_upper": 3},
    }
    if name not in known:
        raise typer.BadParameter(f"unknown method {name!r}", param_hint="--methods")
    return known[name]


def program_environment(joined: Member, endpoint: str, namespace: str, folder: Path) -> dict:
    """What a `command` job's member gives its program (environment.py), for this member."""
    assert joined.roster is not None and joined.rank is not None
    roster = {
        "job_id": JOB,
        "round": joined.round,
        "world_size": joined.world_size,
        "master": {"addr": "127.0.0.1", "port": 1},
        "members": [
            {"rank": r, "address": "127.0.0.1", "endpoint_port": 0}
            for r in range(joined.world_size)
        ],
    }
    path = folder / f"roster{joined.rank}.json"
    path.write_text(json.dumps(roster))
    return {
        "COORDINATOR_JOB": JOB,
        "COORDINATOR_RANK": str(joined.rank),
        "COORDINATOR_WORLD_SIZE": str(joined.world_size),
        "COORDINATOR_ROSTER": str(path),
        "COORDINATOR_ARTIFACTS": str(folder),
        "COORDINATOR_ETCD": endpoint,
        "COORDINATOR_NAMESPACE": namespace,
        "COORDINATOR_ROUND": str(joined.round),
        "COORDINATOR_LEASE": f"{joined.lease_id:x}",
    }


def member(
    endpoint: str, namespace: str, p: int, method: str, beta: int, steps: int, repeat: int,
    folder: str,
) -> dict[str, list[tuple[float, float, float]]]:  # fmt: skip
    """One member process: rendezvous, then built-in and user-code runs, alternated;
    per path, (began, ended, CPU seconds) of each run."""
    args = method_args(method, beta)
    spec, _ = check_steps(
        method, args.get("staleness", 0), args.get("sample", 0),
        args.get("staleness_upper", 0), "fail", p,
    )  # fmt: skip
    runs: dict[str, list[tuple[float, float, float]]] = {"builtin": [], "user": []}
    with (
        Etcd(endpoint, namespace=namespace) as etcd,
        Member(etcd, JOB, p, ttl=10, timeout=120) as joined,
    ):
        joined.rendezvous()
        ctx = Context(program_environment(joined, endpoint, namespace, Path(folder)))
        for i in range(repeat):
            joined.barrier(f"builtin-{i}")
            runs["builtin"].append(builtin_run(joined, spec, steps, i))
            joined.barrier(f"user-{i}")
            runs["user"].append(user_run(ctx, args, method, steps))
        joined.barrier("end")
        ctx.close()
        joined.cleaner()
    return runs


def builtin_run(joined: Member, spec: BarrierSpec, steps: int, i: int) -> tuple[float, ...]:
    barrier = LiveBarrier(joined, spec, root=f"{joined.keys.job}bench/{i}/")
    began, cpu = time.time(), time.process_time()
    barrier.start()
    for _ in range(steps):
        barrier.wait_turn()
        barrier.complete()
    ended, cpu = time.time(), time.process_time() - cpu
    barrier.finish()
    barrier.close()
    return began, ended, cpu


def user_run(ctx: Context, args: dict[str, Any], method: str, steps: int) -> tuple[float, ...]:
    paced = ctx.steps(method, **args)
    began, cpu = time.time(), time.process_time()
    for clock in range(steps):
        paced.wait(clock)
        paced.done(clock + 1)
    ended, cpu = time.time(), time.process_time() - cpu
    paced.finish()
    paced.close()
    return began, ended, cpu


def measure(
    endpoint: str, p: int, method: str, beta: int, steps: int, repeat: int
) -> dict[str, dict[str, float]]:
    """Per path: median wall seconds per step and median CPU seconds per check."""
    namespace = f"/bench-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("spawn")  # no fork: the parent holds gRPC threads
    with tempfile.TemporaryDirectory() as folder, context.Pool(p) as pool:
        work = [(endpoint, namespace, p, method, beta, steps, repeat, folder)] * p
        results = pool.starmap(member, work)
    out: dict[str, dict[str, float]] = {}
    for path in ("builtin", "user"):
        walls, cpus = [], []
        for i in range(repeat):
            runs = [r[path][i] for r in results]
            walls.append((max(r[1] for r in runs) - min(r[0] for r in runs)) / steps)
            cpus.append(statistics.mean(r[2] for r in runs) / steps)
        out[path] = {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}
    return out


def main(
    sizes: str = typer.Option("4,16", help="comma-separated P values"),
    methods: str = typer.Option("bsp,ssp,asp,pbsp,pssp,dssp", help="comma-separated methods"),
    steps: int = typer.Option(60, help="steps per run"),
    repeat: int = typer.Option(3, help="runs of each path, alternated; medians count"),
    beta: int = typer.Option(2, help="pBSP and pSSP sample size"),
) -> None:
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    for name in chosen:
        method_args(name, beta)
    table = Table(title=f"step barrier check, no compute: user code (ctx.steps) / built-in "
                  f"(LiveBarrier); {steps} steps, median of {repeat} alternated runs")  # fmt: skip
    for column in ("P", "method", "built-in ms/step", "user ms/step", "ratio",
                   "built-in CPU ms/check", "user CPU ms/check", "CPU ratio"):  # fmt: skip
        table.add_column(column, justify="right")
    with EmbeddedEtcd() as server:
        server.security.export()  # members and programs log in as root (auth is on)
        for p in (int(s) for s in sizes.split(",")):
            for name in chosen:
                if p - 1 < beta and name.startswith("p"):
                    continue
                got = measure(server.endpoint, p, name, beta, steps, repeat)
                b, u = got["builtin"], got["user"]
                table.add_row(
                    str(p), name,
                    f"{b['wall'] * 1e3:.2f}", f"{u['wall'] * 1e3:.2f}",
                    f"{u['wall'] / b['wall']:.2f}",
                    f"{b['cpu'] * 1e3:.2f}", f"{u['cpu'] * 1e3:.2f}",
                    f"{u['cpu'] / b['cpu']:.2f}",
                )  # fmt: skip
                console.print(f"P={p} {name}: ratio {u['wall'] / b['wall']:.2f}")
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
