"""The service's failover on a 3-member etcd: how long its faults keep it from acting.

    python bench/service_failover.py              # 3 runs
    python bench/service_failover.py --runs 5

Everything is real and on loopback: 3 etcd processes (tests/support/etcd_cluster.py), two
`coordinator serve` replicas, each reaching etcd through a cuttable Link of its own.
Each run measures, in the same run:

1. **etcd election** (the baseline): from SIGKILL of the etcd leader to a surviving
   member reporting itself leader (its `/metrics`, polled every 10 ms).
2. **Write after an etcd leader kill**: the project's etcd client alone (`Etcd.put`
   in a loop, connected to the cluster's first member before the kill, as the
   service is); and the service: from the same SIGKILL to the first submit
   (`POST /v1/jobs`, a noop job of one member) the leading replica answers 201, the
   client retrying at once on a 503. Goal: within the election time plus 1 s.
3. **Replica takeover after a leader cut**: from cutting the leading replica's Link to
   the other replica holding the leader key (a direct client polls it every 10 ms).
   Set by the lease: the cut replica's last renewal (every TTL/3) plus the TTL (5 s).

The killed etcd member is started again, and the cut Link restored, before the next run;
runs alternate which replica is cut.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.security import ENV, EtcdSecurity
from tests.support.etcd_cluster import EtcdCluster, Link
from tests.support.service import ServiceProc, kill_members

console = Console(width=120)
LEADER_TTL = 5  # the service's leadership lease
POLL = 0.01


def wait_for(condition: object, timeout: float, what: str) -> float:
    """Poll `condition` (a callable) until truthy; the monotonic time it first was."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():  # type: ignore[operator]
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout:g}s")
        time.sleep(POLL)


class Bench:
    def __init__(self, folder: Path) -> None:
        self.cluster = EtcdCluster().start()
        self.namespace = f"/bench-failover-{uuid.uuid4().hex[:6]}"
        self.etcd = Etcd(self.cluster.endpoints, namespace=self.namespace, security=EtcdSecurity())
        self.links: list[Link] = []
        self.replicas: list[ServiceProc] = []
        for name in ("a", "b"):
            link = self.cluster.link()
            data = folder / name
            data.mkdir()
            self.links.append(link)
            self.replicas.append(ServiceProc(link.endpoints, self.namespace, data).ready())
        wait_for(lambda: self.leading() is not None, 30, "leading replica")

    def leading(self) -> int | None:
        """Which replica (0 or 1) holds the leader key."""
        kv = self.etcd.get(self.etcd.key("api", "leader"))
        if kv is None:
            return None
        pid = int(kv.value.decode().rsplit("-", 2)[1])
        return next((i for i, r in enumerate(self.replicas) if r.process.pid == pid), None)

    def etcd_leader_kill(self) -> tuple[float, float, float]:
        """(election, first write of a plain etcd client, first service write), seconds
        from the SIGKILL."""
        leader = self.cluster.leader()
        service = self.replicas[self.leading() or 0]
        spec = {"kind": "noop", "workers": 1}
        written: list[float] = []
        refused: list[str] = []

        def submit_until_written() -> None:
            while not written:
                try:
                    answer = service.http.post("/v1/jobs", json=spec)
                except httpx.TransportError:
                    continue
                if answer.status_code == 201:
                    written.append(time.monotonic())
                elif answer.status_code != 503:  # only etcd's absence may refuse it
                    refused.append(f"{answer.status_code}: {answer.text[:300]}")
                    return

        plain: list[float] = []

        def put_until_written() -> None:  # the project's etcd client, on its own
            while not plain:
                try:
                    client.put(client.key("bench", "probe"), "x")
                except EtcdError:
                    continue
                plain.append(time.monotonic())

        client = Etcd(self.cluster.endpoints, namespace=self.namespace, security=EtcdSecurity())
        client.put(client.key("bench", "probe"), "x")  # connected before the kill
        killed_at = time.monotonic()
        self.cluster.kill(leader)
        writer = threading.Thread(target=submit_until_written)
        writer.start()
        putter = threading.Thread(target=put_until_written)
        putter.start()
        elected = wait_for(
            lambda: any(self._is_leader(i) for i in self.cluster.running()), 30, "new etcd leader"
        )
        writer.join(60)
        putter.join(60)
        client.close()
        if refused:
            raise RuntimeError(f"the service refused a submit: {refused[0]}")
        if not written:
            raise TimeoutError("the service wrote nothing within 60 s of the etcd leader kill")
        self.cluster.restart(leader)
        return elected - killed_at, plain[0] - killed_at, written[0] - killed_at

    def _is_leader(self, index: int) -> bool:
        try:
            return "\netcd_server_is_leader 1" in self.cluster._get(index, "/metrics")
        except OSError:
            return False

    def leader_cut(self) -> float:
        """Seconds from cutting the leading replica off to the other one leading."""
        cut = self.leading()
        assert cut is not None
        cut_at = time.monotonic()
        self.links[cut].cut()
        taken = wait_for(lambda: self.leading() == 1 - cut, 60, "takeover by the other replica")
        self.links[cut].restore()
        return taken - cut_at

    def close(self) -> None:
        for replica in self.replicas:
            replica.kill()
            replica.stop()
            kill_members(replica.data)
        self.etcd.close()
        self.cluster.close()


def main(
    runs: int = typer.Option(3, min=1, help="measurements of each fault"),
) -> None:
    for var in ENV.values():  # the bench's etcd has no auth
        os.environ.pop(var, None)
    elections: list[float] = []
    writes: list[float] = []
    plains: list[float] = []
    takeovers: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as folder:
        with console.status("starting 3 etcd members and 2 replicas"):
            bench = Bench(Path(folder))
        try:
            for run in range(runs):
                with console.status(f"run {run + 1}/{runs}: etcd leader kill"):
                    election, plain, write = bench.etcd_leader_kill()
                with console.status(f"run {run + 1}/{runs}: service leader cut"):
                    takeover = bench.leader_cut()
                elections.append(election)
                writes.append(write)
                plains.append(plain)
                takeovers.append(takeover)
                console.print(
                    f"run {run + 1}: election {election:.2f} s, etcd client write {plain:.2f} s, "
                    f"service write {write:.2f} s, "
                    f"takeover {takeover:.2f} s"
                )
        finally:
            bench.close()
    baseline = statistics.median(elections)
    table = Table(title=f"Service failover on a 3-member etcd ({runs} runs, loopback)")
    for column in ("what", "median s", "min s", "max s", "x election", "goal"):
        table.add_column(column, justify="left" if column in ("what", "goal") else "right")
    rows = [
        ("etcd leader kill -> new etcd leader (baseline)", elections, ""),
        ("etcd leader kill -> etcd client's first write", plains, ""),
        ("etcd leader kill -> service's first write", writes, "election + 1 s"),
        ("service leader cut -> other replica leads", takeovers, f"lease TTL {LEADER_TTL} s + 1 s"),
    ]
    for what, values, goal in rows:
        median = statistics.median(values)
        table.add_row(
            what,
            f"{median:.2f}",
            f"{min(values):.2f}",
            f"{max(values):.2f}",
            f"{median / baseline:.1f}",
            goal,
        )
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
