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

With `--proxied`, a third path runs alternated with those: the same user code, but
its client reaches etcd through the member's proxy (`coordinator.etcd.proxy`, a
unix socket, the member's credentials), as a `command` job's program does; the
table then adds its ms/step and its ratio to the direct user path.

A named barrier lines all members up before each run. Per run: wall seconds per
step (the job's: first start to last end, over the steps) and CPU seconds per
check (each member's own process time over its steps, mean over members). The
ratio user/built-in is of the medians, in the same run.

    python bench/context.py                               # P = 4, 16; every method
    python bench/context.py --sizes 4 --methods bsp,ssp --steps 100 --repeat 3
    python bench/context.py --proxied                     # + through the member's proxy
    python bench/context.py --calls                       # the proxy's cost per call
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.barriers.arguments import barrier_spec
from coordinator.barriers.live import LiveBarrier
from coordinator.barriers.policy import BarrierSpec
from coordinator.context import Context
from coordinator.etcd.client import Etcd
from coordinator.etcd.proxy import EtcdProxy
from coordinator.etcd.scope import Scope
from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.keys import job_path
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
    folder: str, proxied: bool = False,
) -> dict[str, list[tuple[float, float, float]]]:  # fmt: skip
    """One member process: rendezvous, then built-in and user-code runs (and proxied
    user-code runs), alternated; per path, (began, ended, CPU seconds) of each run.

    With `proxied` both user paths run in a program process of the member's own (as a
    `command` job's program does), the proxy in the member: they share no interpreter."""
    args = method_args(method, beta)
    spec = barrier_spec(method, **args, stepping=p)
    runs: dict[str, list[tuple[float, float, float]]] = {"builtin": [], "user": [], "proxied": []}
    with (
        Etcd(endpoint, namespace=namespace) as etcd,
        Member(etcd, JOB, p, ttl=10, timeout=120) as joined,
    ):
        joined.rendezvous()
        direct = program_environment(joined, endpoint, namespace, Path(folder))
        if not proxied:
            ctx = Context(direct)
            for i in range(repeat):
                joined.barrier(f"builtin-{i}")
                runs["builtin"].append(builtin_run(joined, spec, steps, i))
                joined.barrier(f"user-{i}")
                runs["user"].append(user_run(ctx, args, method, steps))
            joined.barrier("end")
            ctx.close()
            joined.cleaner()
            return runs
        # The member's proxy, as a `command` member runs it for its program.
        scope = Scope(
            f"{etcd.namespace}/{job_path(JOB)}".encode(), attachable=frozenset({joined.lease_id})
        )
        sockets = Path(tempfile.mkdtemp(prefix="bx-", dir="/tmp"))
        proxy = EtcdProxy(etcd, scope, sockets / f"{joined.rank}.sock").start()
        envs = {"user": direct, "proxied": program_environment(
            joined, proxy.endpoint, namespace, Path(folder))}  # fmt: skip
        ours, theirs = multiprocessing.get_context("spawn").Pipe()
        child = multiprocessing.get_context("spawn").Process(
            target=program, args=(theirs, envs, args, method, steps)
        )
        child.start()
        try:
            for i in range(repeat):
                joined.barrier(f"builtin-{i}")
                runs["builtin"].append(builtin_run(joined, spec, steps, i))
                for path in ("user", "proxied"):
                    joined.barrier(f"{path}-{i}")
                    ours.send(path)
                    runs[path].append(ours.recv())
            joined.barrier("end")
            ours.send(None)
            child.join(30)
        finally:
            if child.is_alive():
                child.kill()
            proxy.close()
            shutil.rmtree(sockets, ignore_errors=True)
        joined.cleaner()
    return runs


def program(
    conn: Any, envs: dict[str, dict[str, str]], args: dict[str, Any], method: str, steps: int
) -> None:
    """A member's program process: one run of the path its member names, until None."""
    contexts = {path: Context(env) for path, env in envs.items()}
    while (path := conn.recv()) is not None:
        conn.send(user_run(contexts[path], args, method, steps))
    for ctx in contexts.values():
        ctx.close()


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


def _to_queue(queue: Any, work: tuple[Any, ...]) -> None:
    queue.put(member(*work))


def measure(
    endpoint: str, p: int, method: str, beta: int, steps: int, repeat: int, proxied: bool
) -> dict[str, dict[str, float]]:
    """Per path: median wall seconds per step and median CPU seconds per check."""
    namespace = f"/bench-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("spawn")  # no fork: the parent holds gRPC threads
    work = (endpoint, namespace, p, method, beta, steps, repeat)
    with tempfile.TemporaryDirectory() as folder:
        if proxied:  # (members start program processes: no pool, whose workers cannot)
            queue = context.Queue()
            members = [
                context.Process(target=_to_queue, args=(queue, (*work, folder, True)))
                for _ in range(p)
            ]
            for started in members:
                started.start()
            results = [queue.get(timeout=1800) for _ in members]
            for started in members:
                started.join(30)
        else:
            with context.Pool(p) as pool:
                results = pool.starmap(member, [(*work, folder)] * p)
    out: dict[str, dict[str, float]] = {}
    for path in ("builtin", "user", "proxied") if proxied else ("builtin", "user"):
        walls, cpus = [], []
        for i in range(repeat):
            runs = [r[path][i] for r in results]
            walls.append((max(r[1] for r in runs) - min(r[0] for r in runs)) / steps)
            cpus.append(statistics.mean(r[2] for r in runs) / steps)
        out[path] = {"wall": statistics.median(walls), "cpu": statistics.median(cpus)}
    return out


def per_call(server: EmbeddedEtcd, calls: int = 300) -> None:
    """The proxy's own cost, per call: a put's round trip and a watch event's delivery,
    direct and through the proxy (one process, alternated twice), medians in ms."""
    member_etcd = Etcd(server.endpoint, namespace="/calls", security=server.security)
    lease = member_etcd.grant_lease(60)
    scope = Scope(f"/calls/{job_path(JOB)}".encode(), attachable=frozenset({lease}))
    sockets = Path(tempfile.mkdtemp(prefix="bx-", dir="/tmp"))
    proxy = EtcdProxy(member_etcd, scope, sockets / "calls.sock").start()
    clients = {
        "direct": Etcd(server.endpoint, namespace="/calls", security=server.security),
        "proxied": Etcd(proxy.endpoint, namespace="/calls", probe=job_path(JOB),
                        security=EtcdSecurity()),
    }  # fmt: skip
    key = f"/calls/{job_path(JOB)}"
    try:
        for name in ("direct", "proxied", "direct", "proxied"):
            client = clients[name]
            puts = []
            for i in range(calls):
                began = time.perf_counter()
                client.put(f"{key}k{i % 5}", "x", lease=lease)
                puts.append(time.perf_counter() - began)
            seen = threading.Event()
            watch = client.watch(f"{key}w", lambda _, seen=seen: seen.set(), 0)
            events = []
            for i in range(calls // 3):
                seen.clear()
                began = time.perf_counter()
                member_etcd.put(f"{key}w", str(i))
                seen.wait(5)
                events.append(time.perf_counter() - began)
            watch.cancel()
            console.print(
                f"{name}: put {statistics.median(puts) * 1e3:.2f} ms, "
                f"watch event {statistics.median(events) * 1e3:.2f} ms (medians)"
            )
    finally:
        for client in clients.values():
            client.close()
        proxy.close()
        member_etcd.close()
        shutil.rmtree(sockets, ignore_errors=True)


def main(
    sizes: str = typer.Option("4,16", help="comma-separated P values"),
    methods: str = typer.Option("bsp,ssp,asp,pbsp,pssp,dssp", help="comma-separated methods"),
    steps: int = typer.Option(60, help="steps per run"),
    repeat: int = typer.Option(3, help="runs of each path, alternated; medians count"),
    beta: int = typer.Option(2, help="pBSP and pSSP sample size"),
    proxied: bool = typer.Option(False, help="also user code through the member's proxy"),
    calls: bool = typer.Option(False, help="only the proxy's cost per put and watch event"),
) -> None:
    if calls:
        with EmbeddedEtcd() as server:
            per_call(server)
        return
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    for name in chosen:
        method_args(name, beta)
    table = Table(title=f"step barrier check, no compute: user code (ctx.steps) / built-in "
                  f"(LiveBarrier); {steps} steps, median of {repeat} alternated runs")  # fmt: skip
    columns = ["P", "method", "built-in ms/step", "user ms/step", "ratio",
               "built-in CPU ms/check", "user CPU ms/check", "CPU ratio"]  # fmt: skip
    if proxied:
        columns += ["proxied ms/step", "proxied/user", "proxied CPU ms/check", "CPU proxied/user"]
    for column in columns:
        table.add_column(column, justify="right")
    with EmbeddedEtcd() as server:
        server.security.export()  # members and programs log in as root (auth is on)
        for p in (int(s) for s in sizes.split(",")):
            for name in chosen:
                if p - 1 < beta and name.startswith("p"):
                    continue
                got = measure(server.endpoint, p, name, beta, steps, repeat, proxied)
                b, u = got["builtin"], got["user"]
                row = [
                    str(p), name,
                    f"{b['wall'] * 1e3:.2f}", f"{u['wall'] * 1e3:.2f}",
                    f"{u['wall'] / b['wall']:.2f}",
                    f"{b['cpu'] * 1e3:.2f}", f"{u['cpu'] * 1e3:.2f}",
                    f"{u['cpu'] / b['cpu']:.2f}",
                ]  # fmt: skip
                said = f"P={p} {name}: ratio {u['wall'] / b['wall']:.2f}"
                if proxied:
                    x = got["proxied"]
                    row += [f"{x['wall'] * 1e3:.2f}", f"{x['wall'] / u['wall']:.2f}",
                            f"{x['cpu'] * 1e3:.2f}", f"{x['cpu'] / u['cpu']:.2f}"]  # fmt: skip
                    said += f", proxied/user {x['wall'] / u['wall']:.2f}"
                table.add_row(*row)
                console.print(said)
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
