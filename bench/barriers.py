"""Per-step overhead of the live step barrier with no compute: BSP against pBSP(beta).

P members are threads in one process, each with its own etcd connection (as
separate workers would have), against an embedded etcd on loopback. After the
rendezvous and the start barrier, every member runs `--steps` steps of
`wait_turn` + `complete` with no work in between; the time per step is the
whole job's wall time over the steps. Operations are the requests each
member's client sent during the steps (puts, reads, watch creations), per
worker per step. The floor, measured in the same run: one put and the watch
notification it causes, seen by another client.

    python bench/barriers.py                       # P = 4, 16, 64
    python bench/barriers.py --sizes 4,16 --steps 100 --beta 4

Threads share one Python interpreter (GIL), so at large P the figures include
Python's own contention, not only etcd's; a per-process run would be lower.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.barriers.live import LiveBarrier
from coordinator.barriers.policy import BarrierSpec, Method
from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.rendezvous.member import Member

console = Console(width=150)


def floor(endpoint: str, repeats: int = 200) -> float:
    """Median seconds from a put by one client to the watch notification at another."""
    namespace = f"/bench-{uuid.uuid4().hex[:8]}"
    writer, reader = Etcd(endpoint, namespace=namespace), Etcd(endpoint, namespace=namespace)
    key = writer.key("floor")
    seen = threading.Event()
    revision = writer.put(key, "0")
    watch = reader.watch(key, lambda events: seen.set(), revision + 1)
    samples = []
    try:
        for i in range(repeats):
            seen.clear()
            began = time.perf_counter()
            writer.put(key, str(i))
            if not seen.wait(10):
                raise RuntimeError("the floor's watch notification never came")
            samples.append(time.perf_counter() - began)
    finally:
        watch.cancel()
        writer.close()
        reader.close()
    return statistics.median(samples)


def measure(endpoint: str, p: int, spec: BarrierSpec, steps: int) -> dict[str, float]:
    """Seconds per step, etcd operations per worker per step, reads per check."""
    namespace = f"/bench-{uuid.uuid4().hex[:8]}"
    clients = [Etcd(endpoint, namespace=namespace) for _ in range(p)]
    began: list[float] = []
    ended: list[float] = []
    ops: list[int] = []
    reads: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(etcd: Etcd) -> None:
        try:
            with Member(etcd, "bench", p, ttl=10, timeout=120) as member:
                member.rendezvous()
                barrier = LiveBarrier(member, spec)
                barrier.start()
                before, t0 = etcd.operations, time.perf_counter()
                for _ in range(steps):
                    barrier.wait_turn()
                    barrier.complete()
                t1, after = time.perf_counter(), etcd.operations
                barrier.finish()
                with lock:
                    began.append(t0)
                    ended.append(t1)
                    ops.append(after - before)
                    reads.append(barrier.counters.reads / max(1, barrier.counters.checks))
                member.barrier("training")
                member.cleaner()
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=one, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for client in clients:
        client.close()
    if errors:
        raise errors[0]
    return {
        "per_step": (max(ended) - min(began)) / steps,
        "ops": sum(ops) / p / steps,
        "reads": statistics.mean(reads),
    }


def main(
    sizes: str = typer.Option("4,16,64", help="comma-separated P values"),
    steps: int = typer.Option(100, help="steps per member"),
    beta: int = typer.Option(4, help="pBSP sample size"),
) -> None:
    specs = [BarrierSpec(Method.BSP), BarrierSpec(Method.PBSP, sample=beta)]
    with EmbeddedEtcd() as server:
        base = floor(server.endpoint)
        table = Table(title=f"step barrier, no compute; floor (put + watch) = {base * 1e3:.2f} ms")
        for column in ("P", "method", "ms/step", "x floor", "ops/worker/step", "reads/check"):
            table.add_column(column, justify="right")
        for p in (int(s) for s in sizes.split(",")):
            for spec in specs:
                result = measure(server.endpoint, p, spec, steps)
                table.add_row(
                    str(p),
                    str(spec),
                    f"{result['per_step'] * 1e3:.2f}",
                    f"{result['per_step'] / base:.1f}",
                    f"{result['ops']:.2f}",
                    f"{result['reads']:.2f}",
                )
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
