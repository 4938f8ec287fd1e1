"""Per-step overhead of the live step barrier with no compute: BSP against pBSP and pSSP.

P members are separate processes, as live workers are, against an embedded
etcd on loopback. After the rendezvous and the start barrier, every member
runs `--steps` steps of `wait_turn` + `complete` with no work in between; the
time per step is the whole job's wall time over the steps. Operations are the
requests each member's client sent during the steps (transactions, puts,
reads, watch creations, lease keepalives), per worker per step; reads per
check are the peer clocks a check read (no check creates a watch: a worker
makes its watches once, at the start).
The floor, measured in the same run: one put and the watch notification it
causes, seen by another client.

    python bench/barriers.py                       # P = 4, 16, 64
    python bench/barriers.py --sizes 4,16 --steps 100 --beta 4
    python bench/barriers.py --sizes 16 --methods bsp,pbsp   # a subset of the methods
    python bench/barriers.py --sizes 4,16 --repeat 5         # medians: a shared machine is noisy

A BSP step needs every worker to put once and be notified once, so with more
workers than cores a step cannot take less than P times the CPU one
put + notification costs, spread over the cores: the table prints that
bound next to the floor (on a 2-core machine it is what limits P = 16).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
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


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def floor(endpoint: str, etcd_pid: int, repeats: int = 200) -> tuple[float, float]:
    """Median seconds from a put by one client to the watch notification at another,
    and the CPU seconds one such round costs (etcd's and the clients' together)."""
    namespace = f"/bench-{uuid.uuid4().hex[:8]}"
    writer, reader = Etcd(endpoint, namespace=namespace), Etcd(endpoint, namespace=namespace)
    key = writer.key("floor")
    seen = threading.Event()
    revision = writer.put(key, "0")
    watch = reader.watch(key, lambda events: seen.set(), revision + 1)
    samples = []
    cpu_before = cpu_seconds(etcd_pid) + cpu_seconds(os.getpid())
    try:
        for i in range(repeats):
            seen.clear()
            began = time.perf_counter()
            writer.put(key, str(i))
            if not seen.wait(10):
                raise RuntimeError("the floor's watch notification never came")
            samples.append(time.perf_counter() - began)
    finally:
        cpu = cpu_seconds(etcd_pid) + cpu_seconds(os.getpid()) - cpu_before
        watch.cancel()
        writer.close()
        reader.close()
    return statistics.median(samples), cpu / repeats


def member(endpoint: str, namespace: str, p: int, spec: BarrierSpec, steps: int) -> dict:
    """One worker process: rendezvous, start barrier, `steps` empty steps, cleanup."""
    with (
        Etcd(endpoint, namespace=namespace) as etcd,
        Member(etcd, "bench", p, ttl=10, timeout=120) as joined,
    ):
        joined.rendezvous()
        barrier = LiveBarrier(joined, spec)
        barrier.start()
        before, began = etcd.operations, time.time()
        for _ in range(steps):
            barrier.wait_turn()
            barrier.complete()
        ended, after = time.time(), etcd.operations
        barrier.finish()
        joined.barrier("training")
        joined.cleaner()
        checks = max(1, barrier.counters.checks)
        return {
            "began": began,
            "ended": ended,
            "ops": after - before,
            "reads": barrier.counters.reads / checks,
        }


def measure(endpoint: str, p: int, spec: BarrierSpec, steps: int) -> dict[str, float]:
    """Seconds per step, etcd operations per worker per step, reads per check."""
    namespace = f"/bench-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("spawn")  # no fork: the parent holds gRPC threads
    with context.Pool(p) as pool:
        results = pool.starmap(member, [(endpoint, namespace, p, spec, steps)] * p)
    return {
        "per_step": (max(r["ended"] for r in results) - min(r["began"] for r in results)) / steps,
        "ops": sum(r["ops"] for r in results) / p / steps,
        "reads": statistics.mean(r["reads"] for r in results),
    }


def main(
    sizes: str = typer.Option("4,16,64", help="comma-separated P values"),
    steps: int = typer.Option(100, help="steps per member"),
    beta: int = typer.Option(4, help="pBSP and pSSP sample size"),
    staleness: int = typer.Option(1, help="pSSP staleness"),
    methods: str = typer.Option("bsp,pbsp,pssp", help="comma-separated: bsp, pbsp, pssp"),
    repeat: int = typer.Option(1, help="runs of each (P, method), interleaved; the median counts"),
) -> None:
    known = {
        "bsp": BarrierSpec(Method.BSP),
        "pbsp": BarrierSpec(Method.PBSP, sample=beta),
        "pssp": BarrierSpec(Method.PSSP, staleness=staleness, sample=beta),
    }
    chosen = [name.strip() for name in methods.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise typer.BadParameter(f"unknown method(s) {', '.join(unknown)}", param_hint="--methods")
    specs = [known[name] for name in chosen]
    cores = os.cpu_count() or 1
    with EmbeddedEtcd() as server:
        server.security.export()  # members and clients log in as root (auth is on)
        assert server.process is not None
        base, cpu = floor(server.endpoint, server.process.pid)
        table = Table(
            title=f"step barrier, no compute; floor (put + watch) = {base * 1e3:.2f} ms, "
            f"costing {cpu * 1e3:.2f} ms of CPU; {cores} cores"
        )
        step_column = "ms/step" if repeat == 1 else f"ms/step (median of {repeat}: range)"
        columns = ("P", "method", step_column, "x floor", "CPU bound ms", "x CPU bound")
        for column in (*columns, "ops/worker/step", "reads/check"):
            table.add_column(column, justify="right")
        for p in (int(s) for s in sizes.split(",")):
            runs: dict[BarrierSpec, list[dict[str, float]]] = {spec: [] for spec in specs}
            for _ in range(repeat):  # interleaved, so that a busy spell hits every method
                for spec in specs:
                    runs[spec].append(measure(server.endpoint, p, spec, steps))
            for spec in specs:
                times = sorted(run["per_step"] for run in runs[spec])
                result = min(
                    runs[spec], key=lambda run: abs(run["per_step"] - times[len(times) // 2])
                )
                spread = f" ({times[0] * 1e3:.1f}-{times[-1] * 1e3:.1f})" if repeat > 1 else ""
                # Every worker must put and be notified once per step: P floors of CPU
                # shared by the cores is the least a step can take on this machine.
                bound = max(base, p * cpu / cores)
                table.add_row(
                    str(p),
                    str(spec),
                    f"{result['per_step'] * 1e3:.2f}{spread}",
                    f"{result['per_step'] / base:.1f}",
                    f"{bound * 1e3:.2f}",
                    f"{result['per_step'] / bound:.1f}",
                    f"{result['ops']:.2f}",
                    f"{result['reads']:.2f}",
                )
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
