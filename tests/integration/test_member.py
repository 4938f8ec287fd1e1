"""Rendezvous semantics checked in one process with member threads (fast, exact)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.rendezvous.errors import MemberLost, RendezvousTimeout, SessionLost
from coordinator.rendezvous.member import Member


def run_members(
    endpoint: str, namespace: str, n: int, body: Callable[[Member], Any], **options: Any
) -> list[Any]:
    """Run `body` in n member threads, each with its own etcd client; re-raise the first error."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with (
                Etcd(endpoint, namespace=namespace) as etcd,
                Member(etcd, "job", n, **options) as m,
            ):
                results[i] = body(m)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a member thread hung"
    if errors:
        raise errors[0]
    return results


def test_a_reused_barrier_name_never_passes_early(
    etcd_server: EmbeddedEtcd, namespace: str
) -> None:
    """The same barrier name used three times: each use waits for all members again."""
    gate = threading.Event()

    def body(m: Member) -> list[tuple[float, float]]:
        m.rendezvous()
        passes = []
        for _ in range(3):
            if m.rank == 0:
                gate.wait(10) if passes else None  # rank 0 is late to the 2nd and 3rd use
            m.barrier("step")
            passes.append((m.timeline[-1].arrived, m.timeline[-1].passed))
            if m.rank == 1:
                gate.set()
        m.cleaner()
        return passes

    results = run_members(etcd_server.endpoint, namespace, 3, body, ttl=3, timeout=30)
    for use in range(3):
        last_arrival = max(r[use][0] for r in results)
        assert min(r[use][1] for r in results) >= last_arrival


def test_a_barrier_timeout_names_who_is_missing(etcd_server: EmbeddedEtcd, namespace: str) -> None:
    def body_stay(m: Member) -> str:
        m.rendezvous()
        if m.rank == 1:
            done.wait(30)
            return "stayed"
        with pytest.raises(RendezvousTimeout) as info:
            m.barrier("training")
        done.set()
        return str(info.value)

    done = threading.Event()
    results = run_members(etcd_server.endpoint, namespace, 2, body_stay, ttl=3, timeout=1.5)
    assert "phase 'training' timed out after 1.5s waiting for ranks 1" in results


def test_losing_its_own_lease_stops_a_member(etcd_server: EmbeddedEtcd, etcd: Etcd) -> None:
    """Revoking a member's lease behind its back: it raises SessionLost, not a stale pass."""
    with (
        Etcd(etcd_server.endpoint, namespace=etcd.namespace) as own,
        Member(own, "solo", 2, ttl=3, timeout=30) as m,
    ):

        def revoke_when_claimed() -> None:
            while m._session is None or m.rank is None:
                threading.Event().wait(0.01)
            etcd.revoke_lease(m._session.lease_id)

        threading.Thread(target=revoke_when_claimed, daemon=True).start()
        with pytest.raises(SessionLost):
            m.leader_election()


@pytest.mark.parametrize(
    ("job", "world_size", "message"),
    [("a/b", 2, "job id 'a/b'"), ("", 2, "job id ''"), ("ok", 0, "world_size must be at least 1")],
)
def test_bad_job_arguments_are_named(etcd: Etcd, job: str, world_size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Member(etcd, job, world_size)


def test_bad_barrier_name_is_named(etcd_server: EmbeddedEtcd, namespace: str) -> None:
    def body(m: Member) -> str:
        m.rendezvous()
        with pytest.raises(ValueError, match="barrier name 'no/slash'"):
            m.barrier("no/slash")
        m.cleaner()
        return "ok"

    assert run_members(etcd_server.endpoint, namespace, 1, body, ttl=3) == ["ok"]


def test_leader_stops_probing_a_member_that_is_lost(
    etcd_server: EmbeddedEtcd, namespace: str
) -> None:
    """A member that dies after publishing its address: the leader's connect check
    gives up at once with MemberLost instead of retrying until the phase deadline."""

    def body(m: Member) -> str:
        m.leader_election()
        m.ip_exchange()
        if m.rank == 1:
            m._endpoint.close()  # type: ignore[union-attr]  # its process is gone...
            m.close()  # ...and so is its lease
            return "gone"
        started = time.monotonic()
        with pytest.raises(MemberLost, match="member rank 1 was lost during phase"):
            m.connect()
        return f"{time.monotonic() - started:.1f}"

    results = run_members(etcd_server.endpoint, namespace, 2, body, ttl=3, timeout=60)
    assert float(next(r for r in results if r != "gone")) < 10
