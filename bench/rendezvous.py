"""Time from all members started to all holding the roster, ours against PyTorch elastic.

Our members are spread over K processes (`--processes`, by default one per
`--per-process` members), threads in each, so that one interpreter is not the
bottleneck; each member has its own etcd client, made in its process before
the start. All are released together, and
the time ends when the last one has passed `connect` (it holds the roster and
the leader reached it). Everything runs on this machine's loopback.

Per N the table shows where the time goes, each phase ending when its last
member passed it (seconds from the start):

- join: every member holds a rank (`leader_election`);
- publish: the leader has every address and has written the roster;
- read: every member holds the roster (`ip_exchange`);
- connect: the leader reached every member and the `connect` barrier opened.

and what it cost: etcd requests per member (the client's count, every phase
through cleanup, keepalives included), etcd's own count of requests it served
(`grpc_server_msg_received_total` from its /metrics, before and after) and its
rate, and the roster's size in etcd. Ratios: torch's time over ours (above 1:
we are faster), and requests per member over those at the smallest N (flat: 1).
torch (members are threads of this process, as its bench does) runs only up to
`--torch-max`. A second table gives the roster's packed size per member up to
N = 10,000, from a roster built here.

    python bench/rendezvous.py                                  # N = 16, 64, 256, 1000
    python bench/rendezvous.py --sizes 16,64 --processes 2 --skip-torch
    python bench/rendezvous.py --sizes 512 --skip-torch --ttl 30  # docs/performance.md
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from multiprocessing.synchronize import Event as ProcessEvent
from pathlib import Path
from queue import Empty
from typing import Any

import typer
from grpc import _common as grpc_common
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))  # for tests.support

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.rendezvous.member import Member
from coordinator.rendezvous.roster import MAX_WORLD_SIZE
from tests.support.rosters import synthetic_roster

console = Console(width=160)

PHASES = ("leader_election", "ip_exchange")


@dataclass(frozen=True)
class MemberResult:
    """What one member reports back to the parent (wall-clock times)."""

    rank: int
    passed: dict[str, float]  # phase -> when this member passed it
    holds_roster_at: float  # after connect
    done_at: float  # after cleanup
    operations: float
    roster_written_at: float | None
    roster_bytes: int
    roster_size: int  # members in the roster it holds


def _run_members(
    n: int,
    count: int,
    endpoint: str,
    namespace: str,
    timeout: float,
    ttl: int,
    ready: Any,
    start: ProcessEvent,
    results: Any,
    shared: bool = False,
) -> None:
    """One process's share: `count` member threads, released by `start`; `shared`: all
    through one etcd client (one connection and one watch stream for the process)."""
    # gRPC's blocking stream reads wake every 0.1 s (so that the main thread's signal
    # handlers run); each member's watch thread blocks in one. A member process has
    # one; this one has hundreds, whose wake-ups (thousands a second) would contend
    # for its one interpreter lock and measure this packing, not the rendezvous.
    grpc_common.MAXIMUM_WAIT_TIMEOUT = 1.0
    # On a real deployment etcd has its own host; here it shares two cores with
    # hundreds of members, whose turn comes after etcd's.
    os.nice(10)
    if shared:
        clients = [Etcd(endpoint, namespace=namespace, connect_timeout=60)] * count
    else:
        clients = [Etcd(endpoint, namespace=namespace, connect_timeout=60) for _ in range(count)]
    unique = list({id(c): c for c in clients}.values())
    go = threading.Event()
    outcomes: list[MemberResult | str] = []
    lock = threading.Lock()

    def one(etcd: Etcd) -> None:
        member = Member(etcd, "bench", n, ttl=ttl, timeout=timeout)
        go.wait()
        try:
            member.rendezvous()
            holds = time.time()
            member.barrier("training")
            member.cleaner()
            outcome: MemberResult | str = MemberResult(
                rank=member.rank or 0,
                passed={r.phase: r.passed for r in member.timeline},
                holds_roster_at=holds,
                done_at=time.time(),
                operations=etcd.operations,
                roster_written_at=member.roster_written_at,
                roster_bytes=member.roster_bytes,
                roster_size=len(member.roster.members) if member.roster else 0,
            )
        except BaseException as exc:
            member.close(exc)
            outcome = f"{type(exc).__name__}: {exc}"
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=one, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    before = sum(c.operations for c in unique)
    for c in unique:
        c.operations = 0  # count the rendezvous only, not the connecting
    ready.put(before)
    start.wait()
    go.set()
    for thread in threads:
        thread.join()
    if shared:  # each member's share of what the one client sent
        share = unique[0].operations / count
        outcomes = [replace(o, operations=share) if isinstance(o, MemberResult) else o
                    for o in outcomes]  # fmt: skip
    for c in unique:
        c.close()
    # As plain values: a class of this script is not importable by that name in the parent.
    results.put([asdict(o) if isinstance(o, MemberResult) else o for o in outcomes])


def etcd_requests(metrics_url: str) -> float:
    """Messages etcd's gRPC server has received so far (every unary call and every
    message on a stream: watch creates and cancels, keepalives)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("grpc_server_msg_received_total{")
    )


def measure_ours(
    n: int,
    endpoint: str,
    metrics_url: str,
    processes: int,
    ttl: int = 10,
    timeout: float = 120.0,
    shared: bool = False,
) -> dict[str, float]:
    """One rendezvous of n members over `processes` processes: phase times and costs."""
    namespace = f"/bench-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("spawn")  # no fork: gRPC is not fork-safe
    ready, results = context.Queue(), context.Queue()
    start = context.Event()
    shares = [n // processes + (i < n % processes) for i in range(processes)]
    shares = [s for s in shares if s > 0]
    workers = [
        context.Process(
            target=_run_members,
            args=(n, share, endpoint, namespace, timeout, ttl, ready, start, results, shared),
            daemon=True,
        )
        for share in shares
    ]
    for worker in workers:
        worker.start()
    stage = "connect their clients"
    try:
        for _ in workers:
            ready.get(timeout=120)
        stage = "finish"
        requests_before = etcd_requests(metrics_url)
        started = time.time()
        start.set()
        outcomes: list[MemberResult | str] = []
        for _ in workers:
            reported = results.get(timeout=timeout + 60)
            outcomes += [MemberResult(**o) if isinstance(o, dict) else o for o in reported]
        ended = max((o.done_at for o in outcomes if isinstance(o, MemberResult)), default=0.0)
        requests = etcd_requests(metrics_url) - requests_before
    except Empty:
        raise RuntimeError(f"N={n}: the member processes did not {stage} in time") from None
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    failures = [o for o in outcomes if isinstance(o, str)]
    if failures:
        raise RuntimeError(f"N={n}: {len(failures)} member(s) failed, first: {failures[0]}")
    done = [o for o in outcomes if isinstance(o, MemberResult)]
    if len(done) != n or any(r.roster_size != n for r in done):
        raise RuntimeError(f"N={n}: {len(done)} members reported, not all with the full roster")
    leader = next(r for r in done if r.rank == 0)
    assert leader.roster_written_at is not None
    return {
        "join": max(r.passed["leader_election"] for r in done) - started,
        "publish": leader.roster_written_at - started,
        "read": max(r.passed["ip_exchange"] for r in done) - started,
        "total": max(r.holds_roster_at for r in done) - started,
        "ops_per_member": sum(r.operations for r in done) / n,
        "etcd_requests": requests,
        "etcd_rate": requests / max(ended - started, 1e-9),
        "roster_bytes": leader.roster_bytes,
    }


def roster_table(sizes: list[int]) -> Table:
    table = Table(title="the roster in etcd (built here; members on 64 hosts, default ids)")
    for column in ("N", "plain JSON bytes", "packed bytes", "packed/member", "of etcd's 1.5 MiB"):
        table.add_column(column, justify="right")
    for n in sizes:
        roster = synthetic_roster(n)
        packed = roster.packed()
        table.add_row(
            str(n),
            f"{len(roster.to_etcd()):,}",
            f"{len(packed):,}",
            f"{len(packed) / n:.1f}",
            f"{len(packed) / (1.5 * 2**20):.1%}",
        )
    return table


def main(
    sizes: str = typer.Option("16,64,256,1000", help="member counts"),
    processes: int = typer.Option(
        0, min=0, help="processes our members are spread over (0: one per --per-process)"
    ),
    per_process: int = typer.Option(
        32,
        min=1,
        help="members per process when --processes is 0: every gRPC thread of a process "
        "wakes to check for signals 5-10 times a second, so a process of hundreds of "
        "members spends its time contending for its interpreter lock",
    ),
    repeats: int = typer.Option(1, min=1, help="runs per N; the median time is shown"),
    ttl: int = typer.Option(10, min=2, help="the members' lease TTL (seconds)"),
    shared_client: bool = typer.Option(
        False,
        help="the members of a process share one etcd client: each client brings gRPC "
        "threads that wake to poll, so 1,000 clients on 2 cores starve etcd",
    ),
    skip_torch: bool = typer.Option(False, help="measure only our rendezvous"),
    torch_max: int = typer.Option(256, help="run torch only up to this N"),
    torch_timeout: float = typer.Option(120.0, help="give up on a torch rendezvous after this"),
) -> None:
    import torch_elastic

    counts = [int(s) for s in sizes.split(",")]
    backends = {} if skip_torch else torch_elastic.MEASURES
    table = Table(
        title="all members started -> all hold the roster (seconds; members are threads "
        + (f"in {processes} processes)" if processes else f"in processes of up to {per_process})")
    )
    columns = ["N", "join", "publish", "read", "connect = total", "etcd reqs/member*"]
    columns += ["x N0", "etcd served", "etcd req/s", "roster bytes"]
    for column in columns:
        table.add_column(column, justify="right")
    for name in backends:
        table.add_column(f"torch {name}", justify="right")
        table.add_column("ratio", justify="right")
    baseline_ops: float | None = None
    with EmbeddedEtcd() as server:
        server.security.export()  # members and clients log in as root (auth is on)
        metrics_url = f"http://127.0.0.1:{server.health_port}/metrics"
        for n in counts:
            try:
                runs = [
                    measure_ours(
                        n,
                        server.endpoint,
                        metrics_url,
                        min(processes or -(-n // per_process), n),
                        ttl,
                        shared=shared_client,
                    )
                    for _ in range(repeats)
                ]
            except RuntimeError as exc:  # say so in the table, and go on with the next N
                console.print(f"N={n}: {exc}")
                table.add_row(str(n), f"failed: {str(exc)[:60]}")
                continue
            run = min(
                runs, key=lambda r: abs(r["total"] - statistics.median(x["total"] for x in runs))
            )
            ours = run["total"]
            baseline_ops = baseline_ops or run["ops_per_member"]
            row = [
                str(n),
                f"{run['join']:.3f}",
                f"{run['publish']:.3f}",
                f"{run['read']:.3f}",
                f"{ours:.3f}",
                f"{run['ops_per_member']:.1f}",
                f"{run['ops_per_member'] / baseline_ops:.2f}",
                f"{run['etcd_requests']:,.0f}",
                f"{run['etcd_rate']:,.0f}",
                f"{run['roster_bytes']:,}",
            ]
            console.print(f"N={n}: ours {ours:.3f}s ({run['ops_per_member']:.1f} requests/member)")
            for name, measure in backends.items():
                if n > torch_max:
                    row += ["not run", "-"]
                    continue
                theirs = _median_or_reason(
                    [_torch(measure, n, torch_timeout) for _ in range(repeats)]
                )
                if isinstance(theirs, float):
                    row += [f"{theirs:.3f}", f"{theirs / ours:.1f}x"]
                else:
                    row += [
                        theirs,
                        f"> {torch_timeout / ours:.0f}x" if "timeout" in theirs else "-",
                    ]
                console.print(f"N={n}: torch {name} {row[-2]}")
            table.add_row(*row)
    console.print(table)
    console.print(
        "phases: seconds from the start until the last member passed it. * requests each "
        "member's client sent, every phase through cleanup, keepalives included; x N0: over "
        "the first N's. etcd served: messages its gRPC server received in the run (metrics), "
        "and their rate until the last member left. ratio = torch time / ours."
    )
    console.print(roster_table(sorted({*counts, MAX_WORLD_SIZE})))


def _torch(measure: Callable[[int, float], float | str], n: int, timeout: float) -> float | str:
    try:
        return measure(n, timeout)
    except TimeoutError:
        return f"> {timeout:g} (timeout)"


def _median_or_reason(values: list[float | str]) -> float | str:
    reasons = [v for v in values if isinstance(v, str)]
    return reasons[0] if reasons else statistics.median(values)  # type: ignore[type-var]


if __name__ == "__main__":
    typer.run(main)
