"""The agents launcher's speed: submit to running on agents, and one scheduler pass.

    python bench/agents.py                       # N = 4 and 16, 3 runs each; 1,000 jobs, 100 agents
    python bench/agents.py --sizes 4 --runs 5 --jobs 1000 --agents 100

Everything is real and on this machine's loopback: an embedded etcd, one
`coordinator serve` (`--max-workers` = the largest N), real `coordinator agent`
processes and their `coordinator worker` members.

1. **Submit to running.** A noop job of N workers (`seconds` 0) with
   `launcher: agents` (4 agents of N/4 slots each, so every N fits) against the
   same job with `launcher: local` on the same service, alternating, median of
   the runs: seconds from the POST to every member past `connect`, and to
   SUCCEEDED, from the job's event stream (`bench/api.py`'s `through_service`).
   The agents' members start on other processes' word (a watch), so the
   difference is what placement, the assignment watch and reporting cost.
2. **One scheduler pass.** `--jobs` queued jobs (1-8 workers, seeded) and
   `--agents` registered agents (4 slots each; registrations only, nothing runs),
   all in a real etcd: the time of one `Reconciler.reconcile_once`, which places
   jobs in queue order until the head does not fit, one guarded transaction per
   job; then the next pass, which finds no room. Target: well under a second.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from api import NAMESPACE, Service, console, through_service  # bench/api.py

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.etcd.session import Session
from coordinator.service.control.leadership import Leadership
from coordinator.service.control.reconciler import Reconciler, ReconcilerSettings
from coordinator.service.model import JobSpec, JobState, Launcher
from coordinator.service.placement.agents_launcher import AgentsLauncher
from coordinator.service.placement.protocol import AgentRecord
from coordinator.service.store import JobStore
from tests.support.signing import key_files, session_signer
from tests.support.wait import wait_until

AGENTS = 4


def start_agents(endpoint: str, data: Path, slots: int) -> list[subprocess.Popen[bytes]]:
    agents = []
    for n in range(AGENTS):
        args = [
            sys.executable, "-m", "coordinator", "agent", "--etcd", endpoint,
            "--namespace", NAMESPACE, "--id", f"bench-{n}", "--slots", str(slots),
            "--data-dir", str(data / f"agent-{n}"), "--ttl", "5",
            "--service-key", str(key_files()[1]),  # what the bench's services sign with
        ]  # fmt: skip
        log = open(data / f"agent-{n}.log", "wb")  # noqa: SIM115 (the process holds it)
        agents.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT))
    with Etcd(endpoint, namespace=NAMESPACE) as etcd:
        wait_until(
            lambda: len(etcd.get_prefix(etcd.key("agents") + "/")[0]) == AGENTS,
            60,
            "every agent registered",
        )
    return agents


def stop_agents(agents: list[subprocess.Popen[bytes]]) -> None:
    for agent in agents:
        agent.terminate()
    for agent in agents:
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()


def submit_to_running(endpoint: str, sizes: list[int], runs: int) -> Table:
    table = Table(title=f"noop jobs, submit to running: seconds (median of {runs}, alternating)")
    for name in ["N", "to", "agents", "local", "difference", "ratio"]:
        table.add_column(name, justify="right")
    with tempfile.TemporaryDirectory(prefix="bench-agents-") as folder:
        data = Path(folder)
        (data / "service").mkdir()
        service = Service(endpoint, data / "service", max(sizes))
        agents = start_agents(endpoint, data, max(1, max(sizes) // AGENTS))
        try:
            for workers in sizes:
                ours, theirs = [], []
                for n in range(runs):
                    ours.append(through_service(service, workers, "agents"))
                    theirs.append(through_service(service, workers, "local"))
                    console.print(
                        f"N={workers} run {n + 1}: agents {ours[-1][0]:.3f}/{ours[-1][1]:.3f}s, "
                        f"local {theirs[-1][0]:.3f}/{theirs[-1][1]:.3f}s"
                    )
                for index, what in enumerate(["running", "SUCCEEDED"]):
                    a = statistics.median(r[index] for r in ours)
                    b = statistics.median(r[index] for r in theirs)
                    table.add_row(
                        str(workers), what, f"{a:.3f}", f"{b:.3f}", f"{a - b:+.3f}", f"{a / b:.2f}x"
                    )
        finally:
            service.stop()
            stop_agents(agents)
    return table


def scheduler_pass(endpoint: str, jobs: int, agents: int, seed: int) -> Table:
    rng = random.Random(seed)
    logging.getLogger("coordinator").setLevel(logging.ERROR)  # the agents here serve no output
    with Etcd(endpoint, namespace=f"/bench-sched-{os.getpid()}") as etcd:
        session = Session(etcd, 60)
        store = JobStore(etcd, session_signer(), mirror=True)
        leadership = Leadership(etcd, "bench", 5)
        settings = ReconcilerSettings(etcd=endpoint, namespace=etcd.namespace, max_workers=1)
        launchers = {Launcher.AGENTS: AgentsLauncher(etcd, session_signer())}
        reconciler = Reconciler(etcd, store, launchers, settings, leadership)  # type: ignore[arg-type]
        try:
            for n in range(agents):
                # As an agent registers (the model checks it: an invalid record is ignored).
                record = AgentRecord(slots=4, address="127.0.0.1:9", token=secrets.token_hex(16))
                etcd.put(etcd.key("agents", f"a{n:03}"), record.model_dump_json(), session.lease_id)
            with console.status(f"queueing {jobs} jobs"):
                for n in range(jobs):
                    spec = JobSpec(
                        id=f"q{n:04}", kind="noop", workers=rng.randint(1, 8), launcher="agents"
                    )
                    store.submit(spec, time.time())
            wait_until(lambda: len(list(store.scan())) == jobs, 30, "the mirror to hold every job")
            wait_until(leadership.try_to_lead, 10, "the reconciler to lead")  # it acts only then
            timings = []
            for _ in range(2):
                began = time.perf_counter()
                reconciler.reconcile_once(time.time())
                timings.append(time.perf_counter() - began)
            placed = [s.record for s in store.scan() if s.record.state == JobState.STARTING]
            members = sum(r.spec.workers for r in placed)
            assigned, _ = etcd.get_prefix(etcd.key("assignments") + "/", keys_only=True)
            if not placed:  # a registration the launcher ignores places nothing: say so
                raise RuntimeError("no job was placed: are the agents' records still valid?")
            if len(assigned) != members:
                raise RuntimeError(f"{len(assigned)} assignments for {members} placed members")
        finally:
            reconciler.close()
            leadership.close()
            store.close()
            session.close(revoke=True)
            etcd.delete_prefix(etcd.namespace + "/")
    table = Table(title=f"one scheduler pass: {jobs} queued jobs, {agents} agents x 4 slots")
    for name in ["pass", "seconds", "jobs placed", "members", "ms per placed job"]:
        table.add_column(name, justify="right")
    per_job = f"{1000 * timings[0] / len(placed):.1f}" if placed else "-"
    table.add_row("first", f"{timings[0]:.3f}", str(len(placed)), str(members), per_job)
    table.add_row("second: tends the placed, no room", f"{timings[1]:.3f}", "0", "0", "-")
    return table


def main(
    sizes: str = typer.Option("4,16", help="N: members of the timed jobs"),
    runs: int = typer.Option(3, min=1, help="runs of each side per N"),
    jobs: int = typer.Option(1000, min=1, help="queued jobs for the scheduler pass"),
    agents: int = typer.Option(100, min=1, help="registered agents for the scheduler pass"),
    seed: int = 7,
) -> None:
    console.print(f"load average: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores")
    with EmbeddedEtcd() as server:
        server.security.export()  # members and clients log in as root (auth is on)
        tables = [scheduler_pass(server.endpoint, jobs, agents, seed)]
        tables.append(submit_to_running(server.endpoint, [int(n) for n in sizes.split(",")], runs))
    for table in tables:
        console.print(table)


if __name__ == "__main__":
    typer.run(main)
