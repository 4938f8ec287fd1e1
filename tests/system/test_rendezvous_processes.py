"""The rendezvous with real `coordinator worker` processes against a real etcd."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.security import ENV
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.rendezvous.errors import JobFull, MemberLost, RendezvousTimeout
from coordinator.worker import EXIT_ETCD_UNAVAILABLE
from tests.support.processes import member_proc_args, unreachable_etcd, worker_args
from tests.support.wait import wait_until

TTL = 2  # etcd's minimum: a lost member must be noticed within TTL + 2 s


@pytest.mark.parametrize("n", [2, 8, 32])
def test_members_rendezvous_with_distinct_ranks_one_roster_and_true_barriers(
    n: int, etcd_server: EmbeddedEtcd, etcd: Etcd, spawn
) -> None:
    procs = [spawn(worker_args(etcd_server.endpoint, etcd.namespace, "job", n)) for _ in range(n)]
    codes = [p.wait_exit(timeout=120) for p in procs]
    assert codes == [0] * n, [p.stderr[-3:] for p in procs]

    done = [p.wait_event(lambda e: e["event"] == "done") for p in procs]
    assert sorted(d["rank"] for d in done) == list(range(n))
    rosters = {json.dumps(d["roster"], sort_keys=True) for d in done}
    assert len(rosters) == 1, "every member must hold the identical roster"
    roster = done[0]["roster"]
    assert [m["rank"] for m in roster["members"]] == list(range(n))
    # The round's handshake secret lives in etcd only: not in any event or error line.
    assert "secret" not in roster
    for p in procs:
        printed = json.dumps(p.events) + "\n".join(p.stderr)
        assert not re.search(r"[0-9a-f]{64}", printed), "a 32-byte secret was printed"
    assert {m["pid"] for m in roster["members"]} == {p.process.pid for p in procs}

    # No member passes a barrier before the last one has arrived at it.
    for phase in ("leader_election", "connect", "training", "cleaner"):
        records = [next(r for r in d["timeline"] if r["phase"] == phase) for d in done]
        last_arrival = max(r["arrived"] for r in records)
        first_pass = min(r["passed"] for r in records)
        assert first_pass >= last_arrival, f"{phase}: a member passed before the last arrived"

    # The last member out deleted everything the rendezvous wrote.
    assert (
        sum(1 for d in procs if d.wait_event(lambda e: e.get("phase") == "cleaner")["cleaned_up"])
        >= 1
    )
    assert etcd.count_prefix(etcd.key("jobs", "job") + "/") == 0


def _stall_and_kill(phase: str, etcd_server: EmbeddedEtcd, etcd: Etcd, spawn) -> None:
    """Two real workers and one stalled member; kill the stalled one mid-`phase`."""
    endpoint, ns = etcd_server.endpoint, etcd.namespace
    # To be killed inside leader_election the victim must hold a rank while the
    # election still waits, so that case asks for one member more than it starts.
    world = 4 if phase == "leader_election" else 3
    stop_before = "" if phase == "leader_election" else phase
    victim = spawn(member_proc_args(endpoint, ns, "job", world, ttl=TTL, stop_before=stop_before))
    workers = [
        spawn(worker_args(endpoint, ns, "job", world, ttl=TTL, timeout=60)) for _ in range(2)
    ]

    members_prefix = etcd.key("jobs", "job", "rendezvous", "members") + "/"
    if phase == "leader_election":
        wait_until(lambda: etcd.count_prefix(members_prefix) == 3, 30, "three claimed ranks")
        victim_rank = next(
            int(kv.key.rsplit("/", 1)[1])
            for kv in etcd.get_prefix(members_prefix)[0]
            if json.loads(kv.value)["pid"] == victim.process.pid
        )
    else:
        victim_rank = victim.wait_event(lambda e: e["event"] == "stopped")["rank"]
        previous = ["leader_election", "ip_exchange", "connect", "training", "cleaner"]
        before = previous[previous.index(phase) - 1]
        for w in workers:  # both have passed the phase before, so they wait in `phase`
            w.wait_event(lambda e, before=before: e.get("phase") == before)

    victim.kill()
    killed_at = time.monotonic()
    for w in workers:
        assert w.wait_exit(timeout=TTL + 10) == MemberLost.exit_code, w.stderr
        assert w.exited_at is not None and w.exited_at - killed_at <= TTL + 2, (
            f"noticed after {w.exited_at - killed_at:.2f}s"
        )
        failed = w.wait_event(lambda e: e["event"] == "failed")
        assert failed["error"] == "MemberLost"
        assert f"member rank {victim_rank} was lost during phase '{phase}'" in failed["message"]
        assert "lease ended" in failed["message"]


@pytest.mark.parametrize(
    "phase", ["leader_election", "ip_exchange", "connect", "training", "cleaner"]
)
def test_member_killed_mid_phase_makes_the_others_fail_fast(
    phase: str, etcd_server: EmbeddedEtcd, etcd: Etcd, spawn
) -> None:
    _stall_and_kill(phase, etcd_server, etcd, spawn)
    rendezvous = etcd.key("jobs", "job", "rendezvous") + "/"
    wait_until(
        lambda: etcd.count_prefix(rendezvous) == 0, TTL + 2, "no keys left after the failure"
    )
    # What stays on purpose: each survivor that held a rank says whom it lost.
    kvs, _ = etcd.get_prefix(etcd.key("jobs", "job") + "/")
    assert all("/failures/" in kv.key for kv in kvs), [kv.key for kv in kvs]
    records = [json.loads(kv.value) for kv in kvs]
    assert len({r["lost_rank"] for r in records}) <= 1
    assert all(r["error"] == "MemberLost" for r in records)


def test_all_members_killed_leave_no_keys_after_the_ttl(
    etcd_server: EmbeddedEtcd, etcd: Etcd, spawn
) -> None:
    args = member_proc_args(
        etcd_server.endpoint, etcd.namespace, "job", 3, ttl=TTL, stop_before="training"
    )
    members = [spawn(args) for _ in range(3)]
    for m in members:
        m.wait_event(lambda e: e["event"] == "stopped")
    job_prefix = etcd.key("jobs", "job") + "/"
    assert etcd.count_prefix(job_prefix) > 0
    for m in members:
        m.kill()
    killed_at = time.monotonic()
    wait_until(lambda: etcd.count_prefix(job_prefix) == 0, TTL + 3, "the job's keys to expire")
    assert time.monotonic() - killed_at <= TTL + 3


def test_one_member_too_many_gets_job_full(etcd_server: EmbeddedEtcd, etcd: Etcd, spawn) -> None:
    args = member_proc_args(etcd_server.endpoint, etcd.namespace, "job", 2, stop_before="training")
    holders = [spawn(args) for _ in range(2)]
    for h in holders:
        h.wait_event(lambda e: e["event"] == "stopped")
    extra = spawn(worker_args(etcd_server.endpoint, etcd.namespace, "job", 2))
    assert extra.wait_exit(timeout=30) == JobFull.exit_code
    assert "already has 2 members" in extra.wait_event(lambda e: e["event"] == "failed")["message"]
    # The extra member's arrival is gone; the two holders are untouched.
    arrivals = etcd.get_prefix(etcd.key("jobs", "job", "rendezvous", "arrivals") + "/")[0]
    assert len(arrivals) == 2
    assert all(h.process.poll() is None for h in holders)


def test_a_waiting_member_shows_its_threads_on_sigusr1_and_goes_on(
    etcd_server: EmbeddedEtcd, etcd: Etcd, spawn
) -> None:
    """`kill -USR1` is how a user sees where a member that seems stuck waits."""
    waiting = spawn(worker_args(etcd_server.endpoint, etcd.namespace, "job", 2))
    wait_until(lambda: etcd.get_prefix(etcd.key("jobs", "job") + "/")[0], 30, "its arrival")
    dump = "\n".join(waiting.threads())
    assert "in leader_election" in dump and "in _keepalive" in dump  # (and its lease's)
    assert waiting.process.poll() is None


def test_wrong_etcd_address_fails_fast_with_a_clear_message(namespace: str, spawn) -> None:
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        endpoint = unreachable_etcd(unused.getsockname()[1])
        started = time.monotonic()
        proc = spawn(worker_args(endpoint, namespace, "job", 2, connect_timeout=1))
        assert proc.wait_exit(timeout=20) == EXIT_ETCD_UNAVAILABLE
    assert time.monotonic() - started < 1 + 8  # connect timeout plus interpreter start-up
    message = proc.wait_event(lambda e: e["event"] == "failed")["message"]
    assert f"cannot reach etcd at {endpoint} within 1s" in message


def test_phase_deadline_names_the_missing_ranks(
    etcd_server: EmbeddedEtcd, etcd: Etcd, spawn
) -> None:
    args = member_proc_args(etcd_server.endpoint, etcd.namespace, "job", 3, stop_before="training")
    stalled = spawn(args)
    workers = [
        spawn(worker_args(etcd_server.endpoint, etcd.namespace, "job", 3, timeout=3))
        for _ in range(2)
    ]
    stalled_rank = stalled.wait_event(lambda e: e["event"] == "stopped")["rank"]
    # The first to time out leaves; the other may see that departure first, as a
    # MemberLost that repeats the timeout. Either way the stalled rank is named.
    codes = [w.wait_exit(timeout=30) for w in workers]
    assert RendezvousTimeout.exit_code in codes
    assert set(codes) <= {RendezvousTimeout.exit_code, MemberLost.exit_code}
    for w in workers:
        message = w.wait_event(lambda e: e["event"] == "failed")["message"]
        assert f"phase 'training' timed out after 3s waiting for ranks {stalled_rank}" in message


def test_etcd_restart_mid_rendezvous_is_survived(
    spawn, tmp_path: Path, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd stops and comes back on the same data dir while members wait at a barrier:
    every member carries on and finishes, because leases are restored on restart,
    watches resume from their last revision, and requests retry within their window."""
    for variable in ENV.values():  # a plain etcd of its own: not the session's settings
        monkeypatch.delenv(variable, raising=False)
    with EmbeddedEtcd(data_dir=tmp_path / "etcd", auth=False) as server:
        resume = tmp_path / "resume"
        stalled = spawn(
            member_proc_args(server.endpoint, namespace, "job", 3, ttl=5, stop_before="training",
                             resume_file=resume)
        )  # fmt: skip
        workers = [
            spawn(worker_args(server.endpoint, namespace, "job", 3, ttl=5)) for _ in range(2)
        ]
        stalled.wait_event(lambda e: e["event"] == "stopped")
        for w in workers:
            w.wait_event(lambda e: e.get("phase") == "connect")

        server.stop()
        server.start()
        resume.touch()

        assert stalled.wait_exit(timeout=60) == 0, stalled.stderr
        for w in workers:
            assert w.wait_exit(timeout=60) == 0, w.stderr
        with Etcd(server.endpoint, namespace=namespace) as etcd:
            assert etcd.count_prefix(etcd.key("jobs", "job") + "/") == 0


def test_member_killed_while_the_job_trains_stops_the_others_at_once(
    etcd_server: EmbeddedEtcd, etcd: Etcd, spawn
) -> None:
    """A noop job holding 60 s of "training": a kill is acted on within TTL + 2 s, not at
    the next barrier a minute later."""
    args = worker_args(etcd_server.endpoint, etcd.namespace, "job", 3, ttl=TTL, param="seconds=60")
    procs = [spawn(args) for _ in range(3)]
    for proc in procs:
        proc.wait_event(lambda e: e.get("phase") == "connect")
    victim = procs[1]
    rank = victim.wait_event(lambda e: e.get("phase") == "connect")["rank"]
    victim.kill()
    killed_at = time.monotonic()
    for proc in (procs[0], procs[2]):
        assert proc.wait_exit(timeout=TTL + 10) == MemberLost.exit_code
        assert proc.exited_at is not None and proc.exited_at - killed_at < TTL + 2 + 1
        failed = proc.wait_event(lambda e: e["event"] == "failed")
        assert failed["phase"] == "training" and f"rank {rank} " in failed["message"]
