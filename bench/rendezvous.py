"""Time from all members started to all holding the roster, ours against PyTorch elastic.

Members are threads in one process for every system measured (each with its own
client connection, as separate agents would have), so the comparison is like
for like; all are released together and the time ends when the last one holds
the completed rendezvous. Everything runs on this machine's loopback.

    python bench/rendezvous.py                  # N = 16, 64, 128, 256
    python bench/rendezvous.py --sizes 16,64 --repeats 3 --skip-torch

Prints one row per N with the ratios torch/ours (above 1 means we are faster).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.rendezvous.member import Member

console = Console(width=150)


def measure_ours(n: int, endpoint: str, timeout: float = 300.0) -> tuple[float, float]:
    """Seconds until all n members hold the roster, and etcd requests per member."""
    namespace = f"/bench-{uuid.uuid4().hex[:8]}"
    clients = [Etcd(endpoint, namespace=namespace) for _ in range(n)]
    start = threading.Event()
    ready = threading.Barrier(n + 1)
    finished: list[float] = []
    errors: list[BaseException] = []
    members: list[Member] = []
    lock = threading.Lock()

    def one(etcd: Etcd) -> None:
        member = Member(etcd, "bench", n, ttl=10, timeout=timeout)
        with lock:
            members.append(member)
        ready.wait()
        start.wait()
        try:
            member.rendezvous()
            with lock:
                finished.append(time.perf_counter())
            member.barrier("training")
            member.cleaner()
        except BaseException as exc:
            errors.append(exc)
            member.close(exc)

    threads = [threading.Thread(target=one, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    ready.wait()
    before = sum(c.operations for c in clients)
    started = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    operations = sum(c.operations for c in clients) - before
    for c in clients:
        c.close()
    if errors:
        raise errors[0]
    return max(finished) - started, operations / n


def main(
    sizes: str = typer.Option("16,64,128,256", help="member counts"),
    repeats: int = typer.Option(1, min=1, help="runs per N; the median is shown"),
    skip_torch: bool = typer.Option(False, help="measure only our rendezvous"),
    torch_timeout: float = typer.Option(120.0, help="give up on a torch rendezvous after this"),
) -> None:
    import torch_elastic

    backends = {} if skip_torch else torch_elastic.MEASURES
    table = Table(title="all members started -> all hold the roster (seconds; members are threads)")
    table.add_column("N", justify="right")
    table.add_column("ours", justify="right")
    table.add_column("etcd ops/member*", justify="right")
    for name in backends:
        table.add_column(f"torch {name}", justify="right")
        table.add_column("ratio", justify="right")
    with EmbeddedEtcd() as server:
        server.security.export()  # members and clients log in as root (auth is on)
        for n in (int(s) for s in sizes.split(",")):
            runs = [measure_ours(n, server.endpoint) for _ in range(repeats)]
            ours = statistics.median(r[0] for r in runs)
            row = [str(n), f"{ours:.3f}", f"{statistics.median(r[1] for r in runs):.0f}"]
            console.print(f"N={n}: ours {ours:.3f}s")
            for name, measure in backends.items():
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
        "ratio = torch time / our time (above 1: we are faster). * etcd requests per member over "
        "its whole life: every phase through cleanup, keepalives included."
    )


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
