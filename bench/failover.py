"""Failover: from an etcd leader SIGKILL to each client kind's first success.

A real 3-member etcd on loopback (tests/support/etcd_cluster.py, etcd's default 1 s
election timeout). Each repeat starts fresh clients (each at a random member, as
members do), SIGKILLs the raft leader and times, from the kill:

- election: until a surviving member reports itself leader (the baseline);
- member session: a put bound to the member's lease and a renewal of the lease
  (from a thread of its own, as a session renews), both done;
- plain put: one put of a client that holds no lease;
- watch event: until a watch delivers a write sent after the kill (a writer puts
  every 20 ms; each value says when it was sent).

Then the killed member is restarted and the next repeat begins.

    python bench/failover.py                 # 5 repeats
    python bench/failover.py --repeats 10

Prints, per kind, the median and the worst time, and the ratio of the median to
the election's median. The goal: within the election time + 1 s.
"""

from __future__ import annotations

import contextlib
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

sys.path.insert(0, str(Path(__file__).parent.parent))

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.watch import WatchEvent
from tests.support.etcd_cluster import EtcdCluster

console = Console(width=150)

KINDS = ["election", "member session", "plain put", "watch event"]


def client(cluster: EtcdCluster, namespace: str) -> Etcd:
    return Etcd(cluster.endpoints, namespace=namespace, security=EtcdSecurity(), retry_window=30)


def timed(
    results: dict[str, float], kind: str, since: list[float], work: Callable[[], None]
) -> Callable[[], None]:
    """`work` run in a thread once the kill happened; its end time recorded under `kind`."""

    def run() -> None:
        work()
        results[kind] = time.monotonic() - since[0]

    return run


def one_failover(cluster: EtcdCluster, ttl: int) -> dict[str, float]:
    """Seconds from one leader kill to each kind's first success."""
    namespace = f"/bench-failover-{uuid.uuid4().hex[:8]}"
    member, plain, watcher, writer = (client(cluster, namespace) for _ in range(4))
    lease = member.grant_lease(ttl)
    member.put(member.key("warm"), "", lease)
    plain.put(plain.key("warm"), "")
    stop = threading.Event()
    watched = watcher.key("ticks")
    killed_at = [0.0]
    delivered = threading.Event()

    def on_events(events: list[WatchEvent]) -> None:
        # Ticks hold when they were sent: only one sent after the kill counts.
        if killed_at[0] and any(float(e.value) >= killed_at[0] for e in events):
            delivered.set()

    watch = watcher.watch(watched, on_events, start_revision=0)

    def write_ticks() -> None:
        while not stop.is_set():
            with contextlib.suppress(EtcdError):  # during the election: the next one
                writer.put(watched, str(time.monotonic()))
            stop.wait(0.02)  # a steady stream of writes for the watch to deliver

    ticker = threading.Thread(target=write_ticks, daemon=True)
    ticker.start()

    def session() -> None:
        """A put bound to the lease and a renewal, concurrently (a member's session renews
        from a thread of its own); done when both are."""

        def renew() -> None:
            while True:  # as a session renews after a failure
                try:
                    if member.keepalive(lease, timeout=max(member.attempt_timeout, ttl / 3)):
                        return
                except EtcdError:
                    time.sleep(0.5)

        renewal = threading.Thread(target=renew)
        renewal.start()
        member.put(member.key("after"), "", lease)
        renewal.join()

    results: dict[str, float] = {}
    threads = [
        threading.Thread(target=timed(results, kind, killed_at, work))
        for kind, work in (
            ("election", lambda: cluster.leader(timeout=30)),
            ("member session", session),
            ("plain put", lambda: plain.put(plain.key("after"), "")),
            ("watch event", lambda: delivered.wait(30)),
        )
    ]
    leader = cluster.leader()
    killed_at[0] = time.monotonic()
    cluster.kill(leader)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    ticker.join()
    watch.cancel()
    member.revoke_lease(lease)
    plain.delete_prefix(plain.key(""))
    for c in (member, plain, watcher, writer):
        c.close()
    cluster.restart(leader)
    return results


def main(
    repeats: int = typer.Option(5, min=1, help="leader kills"),
    ttl: int = typer.Option(10, min=2, help="the member's lease TTL (seconds)"),
) -> None:
    runs: list[dict[str, float]] = []
    with EtcdCluster() as cluster:
        for i in range(repeats):
            runs.append(one_failover(cluster, ttl))
            line = ", ".join(f"{kind} {runs[-1][kind]:.2f}s" for kind in KINDS)
            console.print(f"repeat {i + 1}: {line}")
    election = statistics.median(r["election"] for r in runs)
    table = Table(title=f"etcd leader SIGKILL -> first success (seconds, {repeats} kills)")
    for column in ("kind", "median", "worst", "median / election", "goal: election + 1 s"):
        table.add_column(column, justify="left" if column == "kind" else "right")
    for kind in KINDS:
        times = [r[kind] for r in runs]
        median = statistics.median(times)
        met = sum(r[kind] <= r["election"] + 1.0 for r in runs)
        table.add_row(
            kind,
            f"{median:.2f}",
            f"{max(times):.2f}",
            f"{median / election:.2f}x",
            "-" if kind == "election" else f"{met}/{repeats} met",
        )
    console.print(table)
    console.print(
        "election = until a surviving member reports itself leader (etcd's default 1 s "
        "election timeout); goal met = that kill's time <= that kill's election + 1 s."
    )


if __name__ == "__main__":
    typer.run(main)
