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
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.rendezvous.member import Member

console = Console()


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
) -> None:
    import torch_elastic

    table = Table(title="rendezvous: all members started -> all hold the roster (seconds)")
    columns = (
        "N",
        "ours",
        "etcd ops/member*",
        "torch c10d",
        "c10d/ours",
        "torch etcd-v2",
        "etcd-v2/ours",
    )
    for column in columns:
        table.add_column(column, justify="right")
    with EmbeddedEtcd() as server:
        for n in (int(s) for s in sizes.split(",")):
            runs = [measure_ours(n, server.endpoint) for _ in range(repeats)]
            ours = statistics.median(r[0] for r in runs)
            ops = statistics.median(r[1] for r in runs)
            row = [str(n), f"{ours:.3f}", f"{ops:.0f}"]
            if skip_torch:
                row += ["-"] * 4
            else:
                for measure in (torch_elastic.measure_c10d, torch_elastic.measure_etcd_v2):
                    values = [measure(n) for _ in range(repeats)]
                    if all(isinstance(v, float) for v in values):
                        theirs = statistics.median(values)  # type: ignore[type-var]
                        row += [f"{theirs:.3f}", f"{theirs / ours:.1f}x"]
                    else:
                        row += [str(next(v for v in values if not isinstance(v, float))), "-"]
            table.add_row(*row)
            console.print(f"N={n} done: ours {ours:.3f}s")
    console.print(table)
    console.print(
        "* etcd requests per member for the whole life of a member "
        "(all phases through cleanup, keepalives included)."
    )


if __name__ == "__main__":
    typer.run(main)
