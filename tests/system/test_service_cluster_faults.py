"""The service on a real 3-member etcd cluster, through the cluster's faults.

Real etcd processes (tests/support/etcd_cluster.py), real `coordinator serve` replicas
and real member processes; a replica is cut off from etcd by cutting its own
Link while everything else still reaches the cluster. Each test also asserts
that nothing is left: no member process, no key under the job prefix, and no
lease but the leading replica's.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.security import ENV, EtcdSecurity
from coordinator.service.control.leadership import Leadership
from coordinator.service.control.reconciler import Reconciler, ReconcilerSettings
from coordinator.service.launchers import Launch, Reservation
from coordinator.service.launchers.local import LocalLauncher
from coordinator.service.model import JobSpec, JobState, Launcher, Member
from coordinator.service.states import TRANSITIONS
from coordinator.service.store import JobStore
from tests.support.etcd_cluster import EtcdCluster, Link
from tests.support.service import ServiceProc, kill_members, no_member_runs, sse, wait_state
from tests.support.signing import session_signer
from tests.support.wait import wait_until

LEADER_TTL = 5  # the service's leadership lease (`ServiceOptions.leader_ttl`)
FINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[EtcdCluster]:
    """A 3-member etcd without auth: no root credentials of other tests' etcd apply."""
    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)
    with EtcdCluster() as running:
        yield running


@pytest.fixture
def inspect(cluster: EtcdCluster, namespace: str) -> Iterator[Etcd]:
    """The test's own view of the cluster, never cut."""
    client = Etcd(cluster.endpoints, namespace=namespace, security=EtcdSecurity())
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def replicas(namespace: str, tmp_path: Path) -> Iterator[Callable[[str, str], ServiceProc]]:
    """`coordinator serve` replicas, each with data of its own (as on hosts of their
    own); stopped, and their members killed, also when the test fails."""
    started: list[ServiceProc] = []

    def start(endpoints: str, name: str) -> ServiceProc:
        folder = tmp_path / name
        folder.mkdir()
        service = ServiceProc(endpoints, namespace, folder)
        started.append(service)
        return service.ready()

    try:
        yield start
    finally:
        for service in started:
            service.kill()  # a cut replica would spend its retries on a clean stop
            service.stop()
        for service in started:
            kill_members(service.data)


def leader_pid(etcd: Etcd) -> int | None:
    """The pid of the replica that holds the leader key (`<host>-<pid>-<suffix>`)."""
    kv = etcd.get(etcd.key("api", "leader"))
    return None if kv is None else int(kv.value.decode().rsplit("-", 2)[1])


def leases(cluster: EtcdCluster) -> list[int]:
    """Every lease in the cluster (the test's own), as etcd's LeaseLeases lists them (by its
    JSON gateway: the gRPC stubs here lack that call)."""
    endpoint = cluster.client_endpoint(cluster.running()[0])
    request = urllib.request.Request(f"http://{endpoint}/v3/lease/leases", data=b"{}")
    with urllib.request.urlopen(request, timeout=5) as response:
        return sorted(int(lease["ID"]) for lease in json.load(response).get("leases", []))


def assert_nothing_left(cluster: EtcdCluster, etcd: Etcd, data: list[Path]) -> None:
    """No member process runs, no attempt left a rendezvous key, and the only lease is the
    leader key's. (What members report beside, such as `failures/`, stays with the job
    until it is deleted: `delete_all` checks that.)"""
    for folder in data:
        for pidfile in folder.glob("logs/*/*/member-*.pid"):
            identity = json.loads(pidfile.read_text())
            member = {"pid": identity["pid"]}
            wait_until(
                lambda m=member: no_member_runs({"attempts": [{"members": [m]}]}),
                10,
                f"member {pidfile} to be gone",
            )
    left, _ = etcd.get_prefix(etcd.key("jobs") + "/")
    assert not [kv.key for kv in left if "/rendezvous/" in kv.key]
    leader = etcd.get(etcd.key("api", "leader"))
    expected = [] if leader is None else [leader.lease]
    wait_until(lambda: leases(cluster) == expected, 10, f"only leases {expected}")


def delete_all(service: ServiceProc, etcd: Etcd, job_ids: list[str]) -> None:
    """Delete the (final) jobs through the API: not a key of theirs is left."""
    for job_id in job_ids:
        assert service.http.delete(f"/v1/jobs/{job_id}").status_code == 204
    assert etcd.count_prefix(etcd.key("jobs") + "/") == 0
    assert etcd.count_prefix(etcd.key("api", "jobs") + "/") == 0


def members_started(data: list[Path]) -> dict[tuple[str, str, str], list[Path]]:
    """Every member started from these data folders, by (run, attempt, member)."""
    found: dict[tuple[str, str, str], list[Path]] = {}
    for folder in data:
        for pidfile in folder.glob("logs/*/*/member-*.pid"):
            key = (pidfile.parent.parent.name, pidfile.parent.name, pidfile.stem)
            found.setdefault(key, []).append(pidfile)
    return found


def assert_agrees_with_events(service: ServiceProc, job_id: str) -> dict[str, Any]:
    """The job is final; its events (every change of its record) move only by legal
    transitions and end in that state, as its last condition does; and a success is
    backed by every member of its last attempt having exited 0."""
    record = service.http.get(f"/v1/jobs/{job_id}").json()
    assert record["state"] in FINAL, record
    assert record["conditions"][-1]["state"] == record["state"], record["conditions"]
    states = [JobState(event["state"]) for _, event in sse(service, job_id, last="1")]
    assert states[-1] == record["state"], states
    moves = [(a, b) for a, b in itertools.pairwise(states) if a != b]
    assert all(b in TRANSITIONS[a] for a, b in moves), moves
    if record["state"] == "SUCCEEDED":
        last = record["attempts"][-1]
        assert [m["exit_code"] for m in last["members"]] == [0] * record["spec"]["workers"]
    return record


class RefusesOneJob(LocalLauncher):
    """A real local launcher whose placement etcd refuses, every time, for one job (a
    request too large, say): a failure of that job alone, not of etcd."""

    def __init__(self, logs: Path, refused: str) -> None:
        super().__init__(logs)
        self.refused = refused
        self.refusals = 0

    def reserve(self, launch: Launch) -> Reservation | None:
        if launch.spec.id == self.refused:
            self.refusals += 1
            raise EtcdError("etcd refused the request: INVALID_ARGUMENT: request is too large")
        return super().reserve(launch)


def test_a_job_etcd_refuses_every_tick_holds_back_no_other_job(
    cluster: EtcdCluster, inspect: Etcd, namespace: str, tmp_path: Path
) -> None:
    """Only etcd being away stops the leader's whole pass: an error of one job's own
    (etcd refusing its request) leaves the jobs after it to run."""
    replica = Replica(cluster, cluster.endpoints, namespace, "only", tmp_path / "logs")
    launcher = RefusesOneJob(replica.logs, "refused")
    try:
        replica.run(launcher)
        store = JobStore(inspect, session_signer())
        for job_id in ("refused", "after"):  # the refused one first in the queue
            store.submit(JobSpec(id=job_id, kind="noop", workers=1), time.time())
        wait_until(
            lambda: store.get("after").record.state == JobState.SUCCEEDED,
            30,
            "the job queued behind the refused one to succeed",
        )
        assert launcher.refusals >= 1
        assert store.get("refused").record.state == JobState.PENDING
    finally:
        replica.close()


# -- 1. the service leader cut off ----------------------------------------------------


def test_a_cut_off_leader_stops_leading_before_another_replica_can_lead(
    cluster: EtcdCluster, inspect: Etcd, namespace: str
) -> None:
    link = cluster.link()
    cut_client = Etcd(link.endpoints, namespace=namespace, security=EtcdSecurity())
    cut, other = Leadership(cut_client, "cut", ttl=3), Leadership(inspect, "other", ttl=3)
    try:
        assert cut.try_to_lead()
        assert not other.try_to_lead()
        link.cut()
        cut_at = time.monotonic()
        # No renewal gets through any more: when it stops leading is fixed from now on.
        stops_at = cut_at + cut.proven_for() - cut.margin
        led_at = wait_until(lambda: other.try_to_lead() and time.monotonic(), 10, "a takeover")
        assert not cut.leading, "the cut leader still believes it leads beside its successor"
        # It stopped with time in hand (its margin, 0.75 s at this TTL), not at the expiry:
        # what it was doing when it stopped has that long to end.
        assert led_at - stops_at > 0.5, f"stopped {led_at - stops_at:.2f}s before"
        assert led_at - cut_at <= 3 + 1  # within the TTL (and etcd's expiry check)
    finally:
        link.restore()
        cut.close()
        other.close()
        cut_client.close()
    wait_until(lambda: leases(cluster) == [], 10, "every lease revoked")


class CutAfterStarting(LocalLauncher):
    """A real local launcher whose replica is cut off from etcd right after it started
    member `cut_at` of a job, before it could record it: the worst moment to be cut."""

    def __init__(self, logs: Path, link: Link, cut_at: int) -> None:
        super().__init__(logs)
        self.link, self.cut_at = link, cut_at
        self.cut_member: Member | None = None
        self.killed_at: float | None = None  # time.time() of the cut member's SIGKILL

    def start(self, launch: Launch, index: int) -> Member:
        member = super().start(launch, index)
        if index == self.cut_at and self.cut_member is None:
            self.link.cut()
            self.cut_member = member
        return member

    def kill(self, member: Member) -> None:
        if self.cut_member is not None and member.pid == self.cut_member.pid:
            self.killed_at = time.time()
        super().kill(member)


class Replica:
    """The service's reconciler and leadership, in this process (what `Service` builds),
    reaching etcd at `endpoints`; its members reach the cluster directly."""

    def __init__(
        self, cluster: EtcdCluster, endpoints: str, namespace: str, name: str, logs: Path
    ) -> None:
        self.etcd = Etcd(endpoints, namespace=namespace, security=EtcdSecurity())
        self.store = JobStore(self.etcd, session_signer(), mirror=True)
        self.leadership = Leadership(self.etcd, name, LEADER_TTL)
        self.logs = logs
        self.launcher: LocalLauncher = LocalLauncher(logs)
        self.cluster, self.namespace = cluster, namespace
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def run(self, launcher: LocalLauncher | None = None) -> Replica:
        self.launcher = launcher or self.launcher
        settings = ReconcilerSettings(
            etcd=self.cluster.endpoints,
            namespace=self.namespace,
            max_workers=4,
            grace=3,
            member_ttl=2,
        )
        reconciler = Reconciler(
            self.etcd, self.store, {Launcher.LOCAL: self.launcher}, settings, self.leadership
        )
        self._thread = threading.Thread(target=reconciler.run, args=(self._stop,), daemon=True)
        self._thread.start()
        self.reconciler = reconciler
        return self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)
            self.reconciler.close()
        self.leadership.close()
        self.store.close()
        self.etcd.close()


def test_a_leader_cut_off_mid_launch_kills_its_unrecorded_member_before_a_successor_starts_it(
    cluster: EtcdCluster, inspect: Etcd, namespace: str, tmp_path: Path
) -> None:
    link = cluster.link()
    cut = Replica(cluster, link.endpoints, namespace, "cut", tmp_path / "cut" / "logs")
    survivor = Replica(cluster, cluster.endpoints, namespace, "survivor", tmp_path / "b" / "logs")
    try:
        cut.run(CutAfterStarting(cut.logs, link, cut_at=1))
        wait_until(lambda: cut.leadership.leading, 10, "the first replica to lead")
        survivor.run()
        spec = JobSpec(id="mid", kind="noop", workers=2, params={"seconds": "30"}, max_restarts=1)
        inspect_store = JobStore(inspect, session_signer())
        inspect_store.submit(spec, time.time())
        launcher = cut.launcher
        assert isinstance(launcher, CutAfterStarting)
        unrecorded = wait_until(lambda: launcher.cut_member, 20, "member 1 to start, then the cut")
        assert unrecorded.pid is not None
        cut_at = time.monotonic()

        def survivor_started_member_1() -> Path | None:
            return next(survivor.logs.glob("*/attempt-1/member-1.pid"), None)

        def survivor_leads() -> bool:
            kv = inspect.get(inspect.key("api", "leader"))
            return kv is not None and kv.value == b"survivor"

        wait_until(survivor_leads, LEADER_TTL + 10, "the survivor to lead")
        assert time.monotonic() - cut_at < LEADER_TTL + 3
        pidfile = wait_until(survivor_started_member_1, 20, "the survivor's member 1")
        # The cut replica's copy of member 1 got SIGKILL before the survivor's started.
        # (The pidfile is written as the member starts; psutil's start times count from a
        # boot time rounded to the second, so they are not compared with the clock.)
        killed_at = launcher.killed_at
        assert killed_at is not None, "the unrecorded member was left running"
        started_at = pidfile.stat().st_mtime
        assert killed_at < started_at, f"killed {killed_at - started_at:.3f}s after"
        print(f"the unrecorded copy was killed {started_at - killed_at:.3f}s before its successor")
        assert no_member_runs({"attempts": [{"members": [{"pid": unrecorded.pid}]}]})
        assert not cut.leadership.leading
        # The record never named the killed copy.
        record = inspect_store.get("mid").record
        assert all(m.pid != unrecorded.pid for a in record.attempts for m in a.members)

        def cancel(current: Any) -> Any:
            return current.model_copy(update={"cancel_requested_at": time.time()})

        inspect_store.update("mid", cancel)
        wait_until(
            lambda: inspect_store.get("mid").record.state == JobState.CANCELLED,
            30,
            "the job to be cancelled",
        )
        link.restore()  # the cut replica may now give up what it holds
        cut.close()
        assert_nothing_left(cluster, inspect, [tmp_path / "cut", tmp_path / "b"])
    finally:
        link.restore()
        cut.close()
        survivor.close()
        kill_members(tmp_path / "cut")
        kill_members(tmp_path / "b")


@pytest.mark.slow  # about 18 s: the lease TTL, two services' start, a restart
def test_a_cut_off_service_leader_yields_and_the_other_replica_runs_every_job_once(
    cluster: EtcdCluster,
    inspect: Etcd,
    replicas: Callable[[str, str], ServiceProc],
) -> None:
    link = cluster.link()
    first = replicas(link.endpoints, "first")
    wait_until(lambda: leader_pid(inspect) == first.process.pid, 20, "the first replica to lead")
    second = replicas(cluster.link().endpoints, "second")
    running = {"id": "running", "kind": "noop", "workers": 2, "params": {"seconds": "30"},
               "max_restarts": 2}  # fmt: skip
    assert first.http.post("/v1/jobs", json=running).status_code == 201
    wait_state(second, "running", {"RUNNING"}, timeout=60)

    cut_at, cut_wall = time.monotonic(), time.time()
    link.cut()  # the first replica and its members lose etcd; the second does not
    wait_until(lambda: leader_pid(inspect) == second.process.pid, LEADER_TTL + 5, "a new leader")
    assert time.monotonic() - cut_at < LEADER_TTL + 3
    ids = [f"after-{n}" for n in range(3)]
    for job_id in ids:
        spec = {"id": job_id, "kind": "noop", "workers": 2}
        assert second.http.post("/v1/jobs", json=spec).status_code == 201
    for job_id in ids:
        wait_state(second, job_id, FINAL, timeout=60)
    # The job the first replica ran lost its members with it; the second restarts it.
    wait_until(
        lambda: len(second.http.get("/v1/jobs/running").json()["attempts"]) >= 2,
        30,
        "the second replica to restart the cut replica's job",
    )
    cancel = second.http.post("/v1/jobs/running/cancel")
    assert cancel.status_code == 202
    wait_state(second, "running", FINAL, timeout=60)

    for job_id in ids:
        assert assert_agrees_with_events(second, job_id)["state"] == "SUCCEEDED"
    record = assert_agrees_with_events(second, "running")
    assert len(record["attempts"]) >= 2, "the first replica's attempt did not end"
    started = members_started([first.data, second.data])
    twice = {key: paths for key, paths in started.items() if len(paths) > 1}
    assert not twice, f"members started twice: {twice}"
    # The cut replica started nothing once cut; every member started is one a record names.
    assert all(path.stat().st_mtime < cut_wall for path in first.data.glob("logs/*/*/*.pid"))
    assert len(started) == 2 * len(ids) + sum(len(a["members"]) for a in record["attempts"])
    assert_nothing_left(cluster, inspect, [first.data, second.data])
    delete_all(second, inspect, [*ids, "running"])


# -- 2. the etcd leader killed during a submit burst -------------------------------


@pytest.mark.slow
def test_a_submit_burst_through_an_etcd_leader_kill_loses_no_job(
    cluster: EtcdCluster,
    inspect: Etcd,
    replicas: Callable[[str, str], ServiceProc],
) -> None:
    service = replicas(cluster.endpoints, "service")
    wait_until(lambda: leader_pid(inspect) == service.process.pid, 20, "the service to lead")
    accepted: list[str] = []
    refused: list[str] = []
    for n in range(30):
        if n == 5:
            cluster.kill(cluster.leader())
        spec = {"id": f"burst-{n}", "kind": "noop", "workers": 1, "max_restarts": 2}
        while True:  # what a client does: a clear 503 is retried, the same spec is safe
            try:
                response = service.http.post("/v1/jobs", json=spec)
            except httpx.TimeoutException as exc:
                raise AssertionError(f"submit {n} hung: {exc}") from exc
            if response.status_code in (200, 201):
                accepted.append(spec["id"])
                break
            assert response.status_code == 503, response.text
            assert "etcd" in response.json()["detail"]
            refused.append(spec["id"])
    assert len(accepted) == 30
    print(f"30 submits accepted, {len(refused)} answers 503 retried")
    for job_id in accepted:
        record = wait_state(service, job_id, FINAL, timeout=90)
        assert record["state"] == "SUCCEEDED", record
        assert_agrees_with_events(service, job_id)
    listed = service.http.get("/v1/jobs", params={"limit": 100}).json()
    assert sorted(j["id"] for j in listed["jobs"]) == sorted(accepted)
    assert_nothing_left(cluster, inspect, [service.data])
    delete_all(service, inspect, accepted)


# -- 3. quorum lost, then restored ----------------------------------------------------


@pytest.mark.slow
def test_quorum_lost_then_restored_answers_503_meanwhile_and_every_job_ends_consistently(
    cluster: EtcdCluster,
    inspect: Etcd,
    replicas: Callable[[str, str], ServiceProc],
) -> None:
    service = replicas(cluster.endpoints, "service")
    wait_until(lambda: leader_pid(inspect) == service.process.pid, 20, "the service to lead")
    ids = [f"q-{n}" for n in range(3)]
    for job_id in ids:
        spec = {"id": job_id, "kind": "noop", "workers": 2, "params": {"seconds": "4"},
                "max_restarts": 2}  # fmt: skip
        assert service.http.post("/v1/jobs", json=spec).status_code == 201
    wait_state(service, ids[0], {"RUNNING"}, timeout=60)

    leader = cluster.leader()
    lost = [leader, next(i for i in range(cluster.size) if i != leader)]  # 2 of 3: no quorum
    for index in lost:
        cluster.kill(index)
    lost_at = time.monotonic()
    answers: list[tuple[float, float]] = []  # seconds to the 503 of a submit, of /readyz
    while time.monotonic() - lost_at < 20:
        began = time.monotonic()
        spec = {"id": "during", "kind": "noop", "workers": 1}
        response = service.http.post("/v1/jobs", json=spec)  # 30 s client timeout: no hang
        assert response.status_code == 503, response.text
        assert "etcd is unavailable" in response.json()["detail"]
        submitted = time.monotonic()
        ready = service.http.get("/readyz")
        assert ready.status_code == 503
        answers.append((submitted - began, time.monotonic() - submitted))
    assert answers
    assert all(submit < 20 for submit, _ in answers), answers
    assert all(ready < 3 for _, ready in answers), answers  # a bounded probe: 1 s of retries
    print("quorum lost: 503 after (submit, readyz)", [f"{a:.1f}s, {b:.1f}s" for a, b in answers])
    for index in lost:
        cluster.restart(index, wait=False)
    for index in lost:
        cluster.wait_healthy(index)

    for job_id in ids:
        wait_state(service, job_id, FINAL, timeout=120)
        record = assert_agrees_with_events(service, job_id)
        print(job_id, record["state"], len(record["attempts"]), record["conditions"][-1]["reason"])
        if record["state"] != "SUCCEEDED":  # then its reason names what it lost
            assert record["conditions"][-1]["reason"], record
    # a job never accepted is nowhere; one accepted late (a lost answer) ends too
    during = service.http.get("/v1/jobs/during")
    if during.status_code == 200:
        assert_agrees_with_events(service, wait_state(service, "during", FINAL, 60)["id"])
        ids.append("during")
    assert_nothing_left(cluster, inspect, [service.data])
    delete_all(service, inspect, ids)
