"""The chaos soak: the whole product on a 3-member etcd, under load, while things die.
The suite's short soak (tests/system/test_chaos.py) and `python bench/chaos.py` (ten
minutes) both run it.

Everything is real and on loopback: a 3-member etcd cluster (tests/support/etcd_cluster.py),
2 `coordinator serve` replicas and 3 `coordinator agent`s, each reaching etcd
through cuttable proxies of its own. Jobs (noop, steps under SSP, xgboost, a small
mnist, and `command` programs that log when they run) are submitted at a steady
rate to either replica, on the agents launcher, with restarts allowed. Meanwhile,
at random moments, one fault at a time: SIGKILL the service leader, an agent, the
etcd leader or a job's member, or cut a service's or an agent's way to etcd for
longer than its lease. Killed processes come back after a few seconds.

Then, once every kind of fault came once at least, the faults stop, every job is
waited for, everything is stopped cleanly, and what must hold is checked
(`Report.problems`):

- every accepted job exists and is final, its state its last condition's;
- no job ran twice at once: its attempts do not overlap, and no two runs of one
  rank of a `command` program overlap (the programs' own log says when they ran);
- every failed job says why;
- no process of the soak and no member's private folder (its roster file) is
  left, and a TTL later no lease and no key but the
  job records.

It prints the faults injected and the time from each to recovery (the service
leads again, the agent is back, etcd serves writes again, the job runs again or
ended, the cut process serves again), and the jobs per outcome.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.server import free_port
from coordinator.jobs.private_folder import PREFIX as PRIVATE_PREFIX
from tests.support.etcd_cluster import EtcdCluster, Link
from tests.support.signing import key_files
from tests.support.wait import WaitTimeout, wait_until

console = Console(width=150)
FINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
NAMESPACE_PREFIX = "/chaos-"
MEMBER_TTL = 2  # the jobs' members: a cut or a kill is seen within 2 s + a little
SERVICE_TTL = 3  # the replicas' leadership and the agents' registration
AGENT_SLOTS = 4
RESTART_AFTER = 3.0  # seconds a killed process stays dead
POLL = 0.1  # seconds between looks at processes and HTTP; no event to wait on
# A command program that says when it ran, in one line each (appends are atomic).
WITNESS = (
    "import os, sys, time, json\n"
    "path = sys.argv[1]\n"
    "start = time.time()\n"
    "time.sleep(float(sys.argv[2]))\n"
    "line = json.dumps({'job': os.environ['COORDINATOR_JOB'], 'rank': int(os.environ['RANK']),"
    " 'pid': os.getpid(), 'start': start, 'end': time.time()})\n"
    "fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)\n"
    "os.write(fd, (line + '\\n').encode())\n"
    "os.close(fd)\n"
)


class Restartable:
    """One process of the soak (a replica or an agent) with its own way to etcd."""

    def __init__(
        self, name: str, args: Callable[[], list[str]], log: Path, link: Link, tmp: Path
    ) -> None:
        self.name, self.args, self.log_path, self.link = name, args, log, link
        self.env = {**os.environ, "TMPDIR": str(tmp)}  # its members' private folders go there
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.args(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process and self.process.poll() is None else None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    recovered_at: float | None = None

    @property
    def recovery(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.at


@dataclass
class Report:
    faults: list[Fault] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    restarted: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Soak:
    """The running product: cluster, replicas, agents, and what was done to them."""

    def __init__(self, root: Path, seed: int) -> None:
        self.root = root
        self.random = random.Random(seed)
        self.namespace = f"{NAMESPACE_PREFIX}{secrets.token_hex(4)}"
        self.cluster = EtcdCluster()
        self.token = secrets.token_urlsafe(24)
        self.token_file = root / "tokens"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, f"exec {self.token}\n".encode())
        os.close(fd)
        self.witness = root / "witness.jsonl"
        self.tmp = root / "tmp"
        self.tmp.mkdir(mode=0o700)
        self.replicas: list[Restartable] = []
        self.ports: dict[str, int] = {}
        self.agents: list[Restartable] = []
        self.report = Report()
        self.lock = threading.Lock()
        self.probe: Etcd | None = None

    # -- the product ------------------------------------------------------

    def start(self) -> None:
        self.cluster.start()
        self.probe = Etcd(self.cluster.endpoints, namespace=self.namespace, timeout=2.0)
        for n in range(2):
            name = f"service-{n}"
            self.ports[name] = free_port()
            self.replicas.append(self._process(name, self._serve_args))
        for n in range(3):
            self.agents.append(self._process(f"agent-{n}", self._agent_args))
        for process in [*self.replicas, *self.agents]:
            process.start()
        for replica in self.replicas:
            wait_until(lambda r=replica: self._answers(r), 60, f"{replica.name} to answer", POLL)
        wait_until(lambda: len(self._registrations()) == len(self.agents), 60, "agents", POLL)

    def _process(
        self, name: str, args: Callable[[str, Path, Link], Callable[[], list[str]]]
    ) -> Restartable:
        """A replica or an agent: its data dir, its own link to etcd, its log."""
        data = self.root / name
        data.mkdir(mode=0o700)
        link = self.cluster.link()
        return Restartable(name, args(name, data, link), self.root / f"{name}.log", link, self.tmp)

    def _serve_args(self, name: str, data: Path, link: Link) -> Callable[[], list[str]]:
        return lambda: [
            sys.executable, "-m", "coordinator", "serve", "--port", str(self.ports[name]),
            "--etcd", link.endpoints, "--namespace", self.namespace, "--data-dir", str(data),
            "--token-file", str(self.token_file), "--default-launcher", "agents",
            "--member-ttl", str(MEMBER_TTL), "--grace", "3", "--max-workers", "4",
            "--signing-key", str(key_files()[0]),  # one key for both replicas
        ]  # fmt: skip

    def _agent_args(self, name: str, data: Path, link: Link) -> Callable[[], list[str]]:
        return lambda: [
            sys.executable, "-m", "coordinator", "agent", "--etcd", link.endpoints,
            "--namespace", self.namespace, "--id", name, "--slots", str(AGENT_SLOTS),
            "--data-dir", str(data), "--ttl", str(SERVICE_TTL),
            "--service-key", str(key_files()[1]),
        ]  # fmt: skip

    def http(self, replica: Restartable) -> httpx.Client:
        return httpx.Client(
            base_url=f"http://127.0.0.1:{self.ports[replica.name]}",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )

    def _answers(self, replica: Restartable) -> bool:
        try:
            with self.http(replica) as client:
                return client.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def _get_prefix(self, *parts: str) -> list[Any]:
        assert self.probe is not None
        try:
            return self.probe.get_prefix(self.probe.key(*parts) + "/")[0]
        except EtcdError:
            return []

    def _registrations(self) -> dict[str, int]:
        """Agent id -> the lease its registration is under (a new one once it came back)."""
        return {kv.key.rsplit("/", 1)[-1]: kv.lease for kv in self._get_prefix("agents")}

    def leader(self) -> Restartable | None:
        """The replica holding the leader key (its value names the replica's pid)."""
        assert self.probe is not None
        try:
            held = self.probe.get(self.probe.key("api", "leader"))
        except EtcdError:
            return None
        if held is None:
            return None
        for replica in self.replicas:
            if replica.pid is not None and f"-{replica.pid}-" in held.value.decode():
                return replica
        return None

    # -- jobs -------------------------------------------------------------

    def job_spec(self, n: int) -> dict[str, Any]:
        pick = self.random.choices(
            ["noop", "steps", "command", "xgboost", "mnist"], weights=[30, 25, 25, 10, 10]
        )[0]
        spec: dict[str, Any] = {
            "id": f"chaos-{n:04d}",
            "kind": pick,
            "workers": self.random.choice([2, 3]),
            "max_restarts": 3,
            "launcher": "agents",
        }
        if pick == "noop":
            spec["params"] = {"seconds": str(self.random.choice([1, 2, 4]))}
        elif pick == "steps":
            spec["params"] = {"method": "ssp", "staleness": "2", "num_steps": "40",
                              "step_seconds": "0.05"}  # fmt: skip
        elif pick == "xgboost":
            spec["params"] = {"rounds": "10"}
        elif pick == "mnist":
            spec["workers"] = 3
            spec["params"] = {"num_steps": "30", "method": "ssp", "staleness": "2"}
        else:
            seconds = str(self.random.choice([1, 2, 3]))
            spec["command"] = [sys.executable, "-c", WITNESS, str(self.witness), seconds]
        return spec

    def submit(self, spec: dict[str, Any], deadline: float) -> bool:
        """Until a replica accepts it (submits are idempotent by id), or the deadline."""
        while time.monotonic() < deadline:
            replica = self.random.choice(self.replicas)
            try:
                with self.http(replica) as client:
                    response = client.post("/v1/jobs", json=spec)
                if response.status_code in (200, 201):
                    return True
                if response.status_code < 500 and response.status_code != 409:
                    raise RuntimeError(f"{spec['id']} refused: {response.text}")
            except httpx.TransportError:
                pass
            time.sleep(0.5)  # the replica is down or etcd is electing: try again
        return False

    def records(self) -> dict[str, dict[str, Any]]:
        for replica in self.replicas:
            try:
                with self.http(replica) as client:
                    found: dict[str, dict[str, Any]] = {}
                    token = None
                    while True:
                        params: dict[str, Any] = {"limit": 500}
                        if token:
                            params["page_token"] = token
                        body = client.get("/v1/jobs", params=params).json()
                        found.update((job["id"], job) for job in body["jobs"])
                        token = body.get("next_page_token")
                        if not token:
                            return found
            except (httpx.TransportError, KeyError, ValueError):
                continue
        return {}

    # -- faults -----------------------------------------------------------

    def inject(self, kind: str) -> Fault | None:
        now = time.monotonic()
        if kind == "service-leader":
            victim = self.leader()
            if victim is None:
                return None
            victim.kill()
            self._later(victim.start)
            return self._watch(Fault(kind, victim.name, now), lambda: self.leader() is not None)
        if kind == "agent":
            victim = self.random.choice(self.agents)
            before = self._registrations().get(victim.name)
            victim.kill()
            self._later(victim.start)
            return self._watch(
                Fault(kind, victim.name, now),
                lambda: self._registrations().get(victim.name, before) != before,
            )
        if kind == "etcd-leader":
            index = self.cluster.leader()
            self.cluster.kill(index)
            self._later(lambda: self.cluster.restart(index))
            return self._watch(Fault(kind, f"etcd m{index}", now), self._etcd_writes)
        if kind == "member":
            members = self._members()
            if not members:
                return None
            pid, job = self.random.choice(members)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return None
            return self._watch(
                Fault(kind, f"{job} pid {pid}", now), lambda: self._runs_or_ended(job)
            )
        if kind == "cut":
            victim = self.random.choice([*self.replicas, *self.agents])
            before = self._registrations().get(victim.name)
            victim.link.cut()
            held = max(MEMBER_TTL, SERVICE_TTL) + 2.0  # its lease is gone by then
            threading.Timer(held, victim.link.restore).start()
            check = (
                (lambda: self._answers(victim) and self.leader() is not None)
                if victim in self.replicas
                else (lambda: self._registrations().get(victim.name, before) != before)
            )
            # (counted from the restore: the cut itself lasts `held`)
            return self._watch(Fault(kind, victim.name, now + held), check, after=held)
        raise ValueError(kind)

    def _later(self, action: Callable[[], None]) -> None:
        timer = threading.Timer(RESTART_AFTER, action)
        timer.daemon = True
        timer.start()

    def _watch(self, fault: Fault, recovered: Callable[[], bool], after: float = 0.5) -> Fault:
        """Note when `recovered` first holds (checked from `after` seconds on)."""

        def run() -> None:
            time.sleep(after)  # the fault must have taken effect before recovery counts
            deadline = fault.at + 120
            while time.monotonic() < deadline:
                try:
                    if recovered():
                        fault.recovered_at = time.monotonic()
                        return
                except Exception:
                    pass
                time.sleep(0.1)  # polling what the fault broke; no event to wait on

        threading.Thread(target=run, daemon=True).start()
        with self.lock:
            self.report.faults.append(fault)
        return fault

    def _etcd_writes(self) -> bool:
        assert self.probe is not None
        try:
            self.probe.put("probe", str(time.time()))
            return True
        except EtcdError:
            return False

    def _members(self) -> list[tuple[int, str]]:
        """(pid, job) of every job member running now (`coordinator worker` processes)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"worker" in argv and self.namespace.encode() in argv and b"--job" in argv:
                job = argv[argv.index(b"--job") + 1].decode()
                found.append((int(entry.name), job))
        return found

    def _runs_or_ended(self, job_id: str) -> bool:
        for replica in self.replicas:
            try:
                with self.http(replica) as client:
                    record = client.get(f"/v1/jobs/{job_id}").json()
            except (httpx.TransportError, ValueError):
                continue
            if record.get("state") in FINAL:
                return True
            attempts = record.get("attempts") or []
            return record.get("state") == "RUNNING" and len(attempts) > 1
        return False

    def leftovers(self) -> list[int]:
        """Processes of the soak still alive (its namespace in their argv or environment)."""
        mine = self.namespace.encode()
        left = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            for name in ("cmdline", "environ"):
                try:
                    if mine in (entry / name).read_bytes():
                        left.append(int(entry.name))
                        break
                except OSError:
                    continue
        return left

    def stop(self) -> None:
        for process in [*self.replicas, *self.agents]:
            process.stop()
        if self.probe is not None:
            self.probe.close()
        self.cluster.close()


FAULTS = ["service-leader", "agent", "etcd-leader", "member", "cut"]


def soak(
    seconds: float, jobs: int, seed: int, fault_every: float, root: Path, drain: float = 300
) -> Report:
    """Run the soak in `root`; the report's `problems` is empty when everything held."""
    chaos = Soak(root, seed)
    report = chaos.report
    began = time.monotonic()
    try:
        chaos.start()
        interval = seconds / jobs
        submitting = time.monotonic()
        end = submitting + seconds
        next_fault = time.monotonic() + fault_every
        n = 0
        while n < jobs:
            due = submitting + (n + 1) * interval
            while time.monotonic() < min(due, end):
                if time.monotonic() >= next_fault:
                    chaos.inject(FAULTS[len(report.faults) % len(FAULTS)])
                    next_fault = time.monotonic() + fault_every * chaos.random.uniform(0.5, 1.5)
                time.sleep(0.05)  # the submit schedule; nothing to wait on
            spec = chaos.job_spec(n)
            if chaos.submit(spec, time.monotonic() + 60):
                report.accepted.append(spec["id"])
            else:
                report.problems.append(f"{spec['id']}: no replica accepted it within 60 s")
            n += 1
        while len(report.faults) < len(FAULTS):  # every kind of fault once at least
            time.sleep(max(0.0, next_fault - time.monotonic()))  # the fault schedule
            chaos.inject(FAULTS[len(report.faults)])
            next_fault = time.monotonic() + fault_every * chaos.random.uniform(0.5, 1.5)
        check_jobs(chaos, report, drain)
        check_witness(chaos, report)
        delete_jobs(chaos, report)
        for process in [*chaos.replicas, *chaos.agents]:
            process.stop()
        check_nothing_left(chaos, report)
    finally:
        chaos.stop()
        report.seconds = time.monotonic() - began
    return report


def check_jobs(chaos: Soak, report: Report, drain: float) -> None:
    accepted = set(report.accepted)

    def all_final() -> dict[str, dict[str, Any]] | None:
        found = chaos.records()
        mine = {k: v for k, v in found.items() if k in accepted}
        return (
            mine
            if len(mine) == len(accepted) and all(r["state"] in FINAL for r in mine.values())
            else None
        )

    try:
        records = wait_until(all_final, drain, "every job final", POLL)
    except WaitTimeout:
        records = chaos.records()
    for job_id in sorted(accepted):
        record = records.get(job_id)
        if record is None:
            report.problems.append(f"{job_id}: lost (accepted, then not listed)")
            continue
        state = record["state"]
        report.outcomes[state] += 1
        attempts = record.get("attempts") or []
        if len(attempts) > 1:
            report.restarted += 1
        if state not in FINAL:
            report.problems.append(f"{job_id}: still {state} after the drain")
        if record["conditions"][-1]["state"] != state:
            report.problems.append(f"{job_id}: state {state} but its last event says otherwise")
        for before, after in itertools.pairwise(attempts):
            if before.get("ended_at") is None or after["started_at"] < before["ended_at"]:
                report.problems.append(
                    f"{job_id}: attempt {after['number']} overlaps the one before"
                )
        if state == "FAILED" and not record["conditions"][-1]["reason"].strip():
            report.problems.append(f"{job_id}: failed without a reason")


def delete_jobs(chaos: Soak, report: Report) -> None:
    """Forget every job: what a job leaves (records, metrics, checkpoints) goes with it."""
    with chaos.http(chaos.replicas[0]) as client:
        for job_id in report.accepted:
            response = client.delete(f"/v1/jobs/{job_id}")
            if response.status_code not in (204, 404):
                report.problems.append(f"{job_id}: delete answered {response.status_code}")


def check_witness(chaos: Soak, report: Report) -> None:
    """No two runs of one rank of a command program overlap in time."""
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    if chaos.witness.exists():
        for line in chaos.witness.read_text().splitlines():
            run = json.loads(line)
            runs.setdefault((run["job"], run["rank"]), []).append((run["start"], run["end"]))
    for (job, rank), spans in runs.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                report.problems.append(f"{job}: rank {rank} ran twice at once")


def check_nothing_left(chaos: Soak, report: Report) -> None:
    try:
        wait_until(lambda: not chaos.leftovers(), 30, "the soak's processes to end", POLL)
    except WaitTimeout:
        left = chaos.leftovers()
        report.problems.append(f"orphan processes: {left}")
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    folders = sorted(p.name for p in chaos.tmp.glob(f"{PRIVATE_PREFIX}*"))
    if folders:  # a killed member's goes as its peers stop, or as the next member starts
        report.problems.append(f"members' private folders left: {folders}")
    assert chaos.probe is not None
    probe = chaos.probe

    try:
        wait_until(
            lambda: not chaos.cluster.leases(),
            MEMBER_TTL + SERVICE_TTL + 10,
            "every lease to end",
            POLL,
        )
    except WaitTimeout:
        report.problems.append(f"leases left: {len(chaos.cluster.leases())}")
    kvs, _ = probe.get_prefix(probe.namespace + "/")
    names = [kv.key.removeprefix(probe.namespace + "/") for kv in kvs]
    extra = sorted(k for k in names if k != "probe")
    if extra:
        shown = ", ".join(extra[:12]) + (f" and {len(extra) - 12} more" if len(extra) > 12 else "")
        report.problems.append(f"keys left once every job was deleted: {shown}")


def print_report(report: Report) -> None:
    faults = Table(title="faults injected: seconds from the fault to recovery")
    for name in ["fault", "count", "median", "max", "not recovered"]:
        faults.add_column(name, justify="right")
    for kind in FAULTS:
        mine = [f for f in report.faults if f.kind == kind]
        times = [f.recovery for f in mine if f.recovery is not None]
        faults.add_row(
            kind,
            str(len(mine)),
            f"{statistics.median(times):.2f}" if times else "-",
            f"{max(times):.2f}" if times else "-",
            str(len(mine) - len(times)),
        )
    console.print(faults)
    jobs = Table(title=f"{len(report.accepted)} jobs accepted, per outcome")
    for name in ["outcome", "jobs"]:
        jobs.add_column(name, justify="right")
    for outcome, count in sorted(report.outcomes.items()):
        jobs.add_row(outcome, str(count))
    jobs.add_row("(restarted at least once)", str(report.restarted))
    console.print(jobs)
    if report.problems:
        console.print(f"[red]{len(report.problems)} problems:[/red]")
        for problem in report.problems:
            console.print(f"  {problem}")
    else:
        console.print(f"[green]all held[/green] ({report.seconds:.0f} s): 0 lost, 0 run twice, "
                      "0 orphans, 0 leaked keys or leases")  # fmt: skip
