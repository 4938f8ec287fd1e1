"""Members as real `coordinator worker` processes on a real 3-member etcd, under faults.

Each member reaches etcd through a `Link` of its own (a cuttable proxy per etcd
member) and is given every endpoint. The faults: the etcd leader SIGKILLed while
members join, while they wait at a named barrier and while a `steps` job runs under
SSP (the job must succeed); one member cut off from etcd for longer than its TTL
(it stops with SessionLost, the others with MemberLost, within TTL + 2 s); and
quorum lost for 20 s (every member fails naming etcd's unavailability, none hangs).
After each, nothing is left: no rendezvous keys, no leases, no processes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.security import ENV, EtcdSecurity
from coordinator.rendezvous.errors import MemberLost, SessionLost
from tests.support.etcd_cluster import EtcdCluster
from tests.support.processes import Proc, member_proc_args, worker_args
from tests.support.wait import wait_until

#: Long enough to outlive an election (about 1-2 s with etcd's defaults) with room.
TTL = 5
#: etcd's minimum, for the cut-off case: the loss must be seen within TTL + 2 s.
SHORT_TTL = 2
JOB = "job"
#: Seconds for processes to start and reach a phase before any fault (a loaded CI host).
STARTUP = 90


@pytest.fixture(autouse=True)
def _plain_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster has neither auth nor TLS: the members these tests start must not take
    the session etcd's settings (in the environment once a test used it)."""
    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster() as started:
        yield started


@pytest.fixture
def etcd_cluster(cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    """The module's cluster, whole again after the test (killed members restarted)."""
    yield cluster
    for index in range(cluster.size):
        if index not in cluster.running():
            cluster.restart(index, wait=False)
    for index in range(cluster.size):
        cluster.wait_healthy(index)


@pytest.fixture
def admin(etcd_cluster: EtcdCluster, namespace: str) -> Iterator[Etcd]:
    """The test's own client, straight to the members (never through a cut link)."""
    client = Etcd(
        etcd_cluster.endpoints, namespace=namespace, security=EtcdSecurity(), retry_window=30
    )
    yield client
    client.close()


def job_keys(admin: Etcd) -> list[str]:
    return [kv.key for kv in admin.get_prefix(admin.key("jobs", JOB) + "/", keys_only=True)[0]]


def assert_nothing_left(
    cluster: EtcdCluster, admin: Etcd, procs: list[Proc], kept: Callable[[str], bool], within: float
) -> None:
    """No process runs, and within `within` s no lease and no job key but those `kept`."""
    assert all(p.process.poll() is not None for p in procs)
    wait_until(lambda: not cluster.leases(), within, "every lease to be gone")
    wait_until(
        lambda: all(kept(key) for key in job_keys(admin)),
        within,
        f"the job's keys to be gone (now: {[k for k in job_keys(admin) if not kept(k)]})",
    )
    assert admin.count_prefix(admin.key("jobs", JOB, "rendezvous") + "/") == 0


def at_training(admin: Etcd) -> int:
    """How many members have arrived at the `training` barrier."""
    return sum("/training/0/arrived/" in key for key in job_keys(admin))


def first_seen(
    procs: list[Proc], predicate: Callable[[dict[str, Any]], bool], timeout: float
) -> list[float]:
    """When each process's first matching event was seen (monotonic), all within `timeout`."""
    seen: dict[int, float] = {}

    def all_seen() -> bool:
        for i, proc in enumerate(procs):
            if i not in seen and any(predicate(e) for e in list(proc.events)):
                seen[i] = time.monotonic()
        return len(seen) == len(procs)

    wait_until(all_seen, timeout, "an event from every process")
    return [seen[i] for i in range(len(procs))]


def succeed(procs: list[Proc], timeout: float = STARTUP) -> list[dict[str, Any]]:
    """Every process exits 0; their `done` events."""
    for proc in procs:
        assert proc.wait_exit(timeout) == 0, proc.stderr[-5:]
    return [p.wait_event(lambda e: e["event"] == "done") for p in procs]


def two_then_one_stalled(
    cluster: EtcdCluster, admin: Etcd, spawn: Callable[[list[str]], Proc], resume: Path, ttl: int
) -> tuple[Proc, list[Proc]]:
    """Three members of JOB, each through its own link: one stops before the `training`
    barrier until `resume` exists (returned once it has stopped), two run on."""
    stalled = spawn(
        member_proc_args(cluster.link().endpoints, admin.namespace, JOB, 3, ttl=ttl,
                         stop_before="training", resume_file=resume)
    )  # fmt: skip
    workers = [
        spawn(worker_args(cluster.link().endpoints, admin.namespace, JOB, 3, ttl=ttl))
        for _ in range(2)
    ]
    stalled.wait_event(lambda e: e["event"] == "stopped", STARTUP)
    return stalled, workers


def kill_leader(cluster: EtcdCluster) -> int:
    leader = cluster.leader()
    cluster.kill(leader)
    return leader


@pytest.mark.slow  # (budget: the steps job below covers a leader kill by default)
def test_leader_killed_while_members_join(
    etcd_cluster: EtcdCluster, admin: Etcd, spawn: Callable[[list[str]], Proc]
) -> None:
    """Two members hold ranks and wait for the third when the leader dies; the third
    joins during the election. All pass every phase, and leave nothing."""

    def member() -> Proc:
        return spawn(worker_args(etcd_cluster.link().endpoints, admin.namespace, JOB, 3, ttl=TTL))

    early = [member() for _ in range(2)]
    members = admin.key("jobs", JOB, "rendezvous", "members") + "/"
    wait_until(lambda: admin.count_prefix(members) == 2, STARTUP, "two claimed ranks")
    kill_leader(etcd_cluster)
    late = member()
    done = succeed([*early, late])
    assert sorted(d["rank"] for d in done) == [0, 1, 2]
    assert len({json.dumps(d["roster"], sort_keys=True) for d in done}) == 1
    assert_nothing_left(etcd_cluster, admin, [*early, late], lambda key: False, within=TTL + 2)


@pytest.mark.slow  # (budget: the steps job below covers a leader kill by default)
def test_leader_killed_while_members_wait_at_a_named_barrier(
    etcd_cluster: EtcdCluster,
    admin: Etcd,
    spawn: Callable[[list[str]], Proc],
    tmp_path: Path,
) -> None:
    """Two members wait at the `training` barrier; the leader dies, and the third
    arrives during the election: the barrier opens for all."""
    resume = tmp_path / "resume"
    stalled, workers = two_then_one_stalled(etcd_cluster, admin, spawn, resume, TTL)
    for w in workers:
        w.wait_event(lambda e: e.get("phase") == "connect", STARTUP)
    wait_until(lambda: at_training(admin) == 2, STARTUP, "two arrivals at the training barrier")
    kill_leader(etcd_cluster)
    resume.touch()
    succeed(workers)
    assert stalled.wait_exit(60) == 0, stalled.stderr[-5:]
    stalled.wait_event(lambda e: e["event"] == "done")
    assert_nothing_left(etcd_cluster, admin, [*workers, stalled], lambda key: False, TTL + 2)


def test_leader_killed_during_a_steps_job_under_ssp(
    etcd_cluster: EtcdCluster, admin: Etcd, spawn: Callable[[list[str]], Proc]
) -> None:
    """The leader dies mid-training: every worker still does exactly its steps."""
    steps = 40
    params = {"method": "ssp", "staleness": 2, "num_steps": steps, "step_seconds": 0.05}
    procs = []
    for _ in range(3):
        args = worker_args(etcd_cluster.link().endpoints, admin.namespace, JOB, 3, ttl=TTL,
                           kind="steps")  # fmt: skip
        procs.append(spawn(args + [a for k, v in params.items() for a in ("--param", f"{k}={v}")]))
    for proc in procs:
        proc.wait_event(lambda e: e["event"] == "step", STARTUP)
    kill_leader(etcd_cluster)
    done = succeed(procs)
    for result in (d["result"] for d in done):
        assert (result["steps"], result["final_clock"]) == (steps, steps)
        assert all(clock - slowest <= 2 for clock, slowest, _ in result["passages"] if slowest)
    # Kept on purpose, unleased: each worker's progress (a restart resumes from it) and
    # the job-wide slowest clock, which must outlive any one worker.
    steps_keys = admin.key("jobs", JOB, "steps") + "/"
    assert_nothing_left(
        etcd_cluster,
        admin,
        procs,
        lambda key: key.startswith(f"{steps_keys}progress/") or key.endswith("/slowest"),
        within=TTL + 2,
    )


def test_member_cut_off_from_etcd_stops_and_the_others_see_it_lost(
    etcd_cluster: EtcdCluster, admin: Etcd, spawn: Callable[[list[str]], Proc]
) -> None:
    """One member's link is cut for longer than its TTL while the job trains."""
    links = [etcd_cluster.link() for _ in range(3)]
    procs = [
        spawn(worker_args(link.endpoints, admin.namespace, JOB, 3, ttl=SHORT_TTL,
                          param="seconds=60", connect_timeout=2))
        for link in links
    ]  # fmt: skip
    ranks = [p.wait_event(lambda e: e.get("phase") == "connect", STARTUP)["rank"] for p in procs]
    victim, others = procs[1], [procs[0], procs[2]]
    links[1].cut()
    cut_at = time.monotonic()

    def failed(event: dict[str, Any]) -> bool:
        return event["event"] == "failed"

    seen = first_seen(procs, failed, timeout=SHORT_TTL + 10)
    assert max(seen) - cut_at <= SHORT_TTL + 2, [round(t - cut_at, 2) for t in seen]

    assert victim.wait_exit(30) == SessionLost.exit_code
    message = victim.wait_event(failed)["message"]
    assert "lease is lost" in message and "etcd unavailable" in message, message
    for proc in others:
        assert proc.wait_exit(30) == MemberLost.exit_code
        event = proc.wait_event(failed)
        assert event["error"] == "MemberLost"
        assert f"member rank {ranks[1]} was lost during phase 'training'" in event["message"]
        assert "lease ended" in event["message"]
    # What stays on purpose: the failure records of those that could still write.
    failures = admin.key("jobs", JOB, "failures") + "/"
    assert_nothing_left(etcd_cluster, admin, procs, lambda key: key.startswith(failures), 5)
    records = [json.loads(kv.value) for kv in admin.get_prefix(failures)[0]]
    assert {r.get("lost_rank") for r in records} == {ranks[1]}, records


@pytest.mark.slow
def test_quorum_lost_for_20_seconds_fails_every_member_naming_etcd(
    etcd_cluster: EtcdCluster, admin: Etcd, spawn: Callable[[list[str]], Proc]
) -> None:
    """Two of three etcd members die for 20 s while the job trains: each member stops
    within its TTL plus its retry window, naming etcd's unavailability; once quorum is
    back the leases expire and nothing is left."""
    procs = [
        spawn(worker_args(etcd_cluster.link().endpoints, admin.namespace, JOB, 3, ttl=TTL,
                          param="seconds=120", connect_timeout=3))
        for _ in range(3)
    ]  # fmt: skip
    for proc in procs:
        proc.wait_event(lambda e: e.get("phase") == "connect", STARTUP)
    leader = etcd_cluster.leader()
    down = [leader, (leader + 1) % etcd_cluster.size]
    for index in down:
        etcd_cluster.kill(index)
    lost_at = time.monotonic()
    for proc in procs:  # every one is out before quorum returns: nobody hangs
        assert proc.wait_exit(timeout=max(0.0, lost_at + 19 - time.monotonic())) == (
            SessionLost.exit_code
        ), proc.stderr[-5:]
        event = proc.wait_event(lambda e: e["event"] == "failed")
        assert event["error"] == "SessionLost"
        assert f"no lease renewal confirmed by etcd for {TTL}s" in event["message"]
        assert "etcd unavailable" in event["message"]
    time.sleep(max(0.0, lost_at + 20 - time.monotonic()))  # the outage lasts 20 s
    for index in down:
        etcd_cluster.restart(index, wait=False)
    for index in down:
        etcd_cluster.wait_healthy(index)
    # The leases outlived the outage (a new leader renews them once) and now expire.
    assert_nothing_left(etcd_cluster, admin, procs, lambda key: False, within=2 * TTL + 5)


@pytest.mark.slow
def test_quorum_lost_for_20_seconds_is_waited_out_with_a_longer_ttl(
    etcd_cluster: EtcdCluster,
    admin: Etcd,
    spawn: Callable[[list[str]], Proc],
    tmp_path: Path,
) -> None:
    """With a TTL longer than the outage, members waiting at a barrier wait it out: no
    lease can expire without a leader, the new leader renews them all, the watches
    resume where they were, and the job succeeds once the last member arrives."""
    ttl = 60  # renewed at most ttl/3 before the outage: 20 + 20 + the restart (slow on a busy host)
    resume = tmp_path / "resume"
    stalled, workers = two_then_one_stalled(etcd_cluster, admin, spawn, resume, ttl)
    wait_until(lambda: at_training(admin) == 2, STARTUP, "two arrivals at the training barrier")
    leader = etcd_cluster.leader()
    down = [leader, (leader + 1) % etcd_cluster.size]
    for index in down:
        etcd_cluster.kill(index)
    time.sleep(20)  # the outage lasts 20 s
    assert all(p.process.poll() is None for p in [*workers, stalled]), "a member gave up"
    for index in down:
        etcd_cluster.restart(index, wait=False)
    for index in down:
        etcd_cluster.wait_healthy(index)
    resume.touch()
    succeed(workers)
    assert stalled.wait_exit(STARTUP) == 0, stalled.stderr[-5:]
    assert_nothing_left(etcd_cluster, admin, [*workers, stalled], lambda key: False, TTL + 2)


@pytest.mark.slow
def test_a_watch_on_a_silent_connection_resumes_on_another_member(
    etcd_cluster: EtcdCluster, admin: Etcd
) -> None:
    """A partition that closes nothing (a frozen link, not a killed process): the watch's
    connection is found dead by its unanswered ping, and the watch resumes elsewhere."""
    link = etcd_cluster.link()
    interval = 6.0  # etcd refuses pings closer than 5 s apart
    watcher = Etcd(link.endpoints, namespace=admin.namespace, security=EtcdSecurity(),
                   ping_interval=interval, retry_window=60)  # fmt: skip
    try:
        seen: list[str] = []
        watch = watcher.watch(admin.key("silent") + "/", lambda events: seen.extend(
            e.key for e in events), start_revision=0, prefix=True)  # fmt: skip
        admin.put(admin.key("silent", "before"), "x")
        wait_until(lambda: len(seen) == 1, 10, "the watch to see a put")
        used = [p for p in link.proxies if p.sockets]
        assert len(used) == 1, "the client holds one connection"
        used[0].freeze()
        frozen_at = time.monotonic()
        admin.put(admin.key("silent", "after"), "x")
        # A ping unanswered for PING_TIMEOUT, then a watch registration that times out on
        # the same silent member (the client's timeout), then the next member.
        bound = interval + 5 + watcher.timeout + 10
        wait_until(lambda: len(seen) == 2, bound, "the watch to resume past the frozen link")
        print(f"watch resumed {time.monotonic() - frozen_at:.1f}s after the freeze")
        watch.cancel()
    finally:
        watcher.close()
        link.close()
