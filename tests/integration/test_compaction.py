"""Watches survive compaction: a real etcd, compacted by hand while a watch is away.

A watch goes away when its connection breaks; here a loopback proxy between the
client and etcd is cut, keys change and etcd compacts its history, then the
proxy comes back. The watch must resume from a fresh read, not wait forever
for a history that no longer exists. The etcd here is the module's own: a
compacted history would change what other tests replay.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pyetcd import etcdrpc

from coordinator.etcd.client import Etcd
from coordinator.etcd.security import ENV
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.etcd.watch import WatchEvent
from coordinator.rendezvous.member import Member
from tests.support.etcd_cluster import CuttableProxy
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd  # its own etcd (see above)


@pytest.fixture(autouse=True)
def _plain_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's etcd is a plain one of its own: no session TLS and auth settings."""
    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def own_etcd() -> Iterator[EmbeddedEtcd]:
    with EmbeddedEtcd(auth=False) as server:
        yield server


@pytest.fixture
def etcd(own_etcd: EmbeddedEtcd, namespace: str) -> Iterator[Etcd]:
    with Etcd(own_etcd.endpoint, namespace=namespace) as client:
        yield client


@pytest.fixture
def proxy(own_etcd: EmbeddedEtcd) -> Iterator[CuttableProxy]:
    running = CuttableProxy(own_etcd.endpoint)
    yield running
    running.close()


def compact(etcd: Etcd) -> int:
    """Compact etcd's history up to now; returns that revision."""
    revision = etcd.put(etcd.key("compaction", "marker"), "x")
    request = etcdrpc.CompactionRequest(revision=revision, physical=True)
    etcd._kv().Compact(request, timeout=10)
    return revision


class Collected:
    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self.lock = threading.Lock()

    def __call__(self, events: list[WatchEvent]) -> None:
        with self.lock:
            self.events += events

    def seen(self, kind: str, key: str, value: bytes | None = None) -> bool:
        with self.lock:
            return any(
                e.kind == kind and e.key == key and (value is None or e.value == value)
                for e in self.events
            )


def test_a_watch_from_a_compacted_revision_starts_from_the_current_state(etcd: Etcd) -> None:
    prefix = etcd.key("w1") + "/"
    first = etcd.put(prefix + "a", "1")
    etcd.put(prefix + "a", "2")
    etcd.put(prefix + "b", "1")
    compact(etcd)
    got = Collected()
    watch = etcd.watch(prefix, got, start_revision=first, prefix=True)
    try:
        wait_until(lambda: got.seen("put", prefix + "a", b"2"), 10, "the current a")
        assert got.seen("put", prefix + "b", b"1")
        etcd.put(prefix + "c", "1")  # and then it watches on as usual
        wait_until(lambda: got.seen("put", prefix + "c", b"1"), 10, "a later put")
    finally:
        watch.cancel()


def test_a_broken_watch_resumes_past_a_compaction_with_what_changed(
    etcd: Etcd, proxy: CuttableProxy
) -> None:
    prefix = etcd.key("w2") + "/"
    etcd.put(prefix + "gone", "1")
    etcd.put(prefix + "kept", "1")
    got, deletes = Collected(), Collected()
    with Etcd(proxy.endpoint, namespace=etcd.namespace) as via_proxy:
        watch = via_proxy.watch(prefix, got, start_revision=1, prefix=True)
        only = via_proxy.watch(prefix, deletes, start_revision=0, prefix=True, only_deletes=True)
        try:
            wait_until(lambda: got.seen("put", prefix + "kept", b"1"), 10, "the first puts")
            proxy.cut()
            etcd.delete(prefix + "gone")
            etcd.put(prefix + "kept", "2")
            etcd.put(prefix + "new", "1")
            compact(etcd)
            proxy.restore()
            wait_until(lambda: got.seen("put", prefix + "new", b"1"), 30, "the resync")
            assert got.seen("put", prefix + "kept", b"2")
            assert got.seen("delete", prefix + "gone")
            gone = next(e for e in got.events if e.kind == "delete")
            assert gone.prev_value == b"1"  # the value the watch knew
            wait_until(lambda: deletes.seen("delete", prefix + "gone"), 30, "the hidden delete")
            assert not any(e.kind == "put" for e in deletes.events)  # only deletes, still
        finally:
            watch.cancel()
            only.cancel()


def test_a_delete_watch_told_its_keys_reports_one_a_compaction_hid(
    etcd: Etcd, proxy: CuttableProxy
) -> None:
    """An only-deletes watch given its keys (`known_keys`, `expect`) reads none at the
    start, yet reports the deletion of an expected key that a compaction hid from it."""
    prefix = etcd.key("w3") + "/"
    revision = etcd.put(prefix + "told", "1")
    etcd.put(prefix + "untold", "1")
    deletes = Collected()
    with Etcd(proxy.endpoint, namespace=etcd.namespace) as via_proxy:
        only = via_proxy.watch(
            prefix, deletes, revision + 2, prefix=True, only_deletes=True, known_keys=()
        )
        try:
            only.expect([prefix + "told"])
            proxy.cut()
            etcd.delete(prefix + "told")
            etcd.delete(prefix + "untold")
            compact(etcd)
            proxy.restore()
            wait_until(lambda: deletes.seen("delete", prefix + "told"), 30, "the hidden delete")
            # Never expected: had the watch read the keys at its start, it would know it.
            assert not deletes.seen("delete", prefix + "untold")
        finally:
            only.cancel()


def test_a_compaction_during_a_barrier_wait_does_not_stall_it(
    own_etcd: EmbeddedEtcd, namespace: str, proxy: CuttableProxy
) -> None:
    """Rank 0 waits at a barrier through the proxy; while it is cut, the other member
    arrives (the barrier opens) and etcd compacts; rank 0 passes once it is back,
    long before its timeout."""
    timeout = 60.0
    arrived = threading.Event()
    outcome: dict[str, Any] = {}

    def through_proxy() -> None:
        try:
            with (
                Etcd(proxy.endpoint, namespace=namespace, connect_timeout=30) as etcd,
                Member(etcd, "compacted", 2, ttl=30, timeout=timeout) as member,
            ):
                member.rendezvous()
                arrived.set()
                began = time.monotonic()
                member.barrier("gate")
                outcome["waited"] = time.monotonic() - began
                member.cleaner()
        except BaseException as exc:
            outcome["error"] = exc

    def direct() -> None:
        with (
            Etcd(own_etcd.endpoint, namespace=namespace) as etcd,
            Member(etcd, "compacted", 2, ttl=30, timeout=timeout) as member,
        ):
            member.rendezvous()
            wait_until(arrived.is_set, 30, "the other member at the barrier")
            wait_until(lambda: _waiting_at_gate(etcd), 30, "its arrival at the gate")
            proxy.cut()
            member.barrier("gate")  # completes the barrier while the other is away
            compact(etcd)
            proxy.restore()
            member.cleaner()

    threads = [threading.Thread(target=through_proxy), threading.Thread(target=direct)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 30)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["waited"] < timeout / 2, f"waited {outcome['waited']:.1f}s"


def _waiting_at_gate(etcd: Etcd) -> bool:
    kvs, _ = etcd.get_prefix(etcd.key("jobs", "compacted", "rendezvous", "barriers") + "/")
    return any("/gate/" in kv.key and "/arrived/" in kv.key for kv in kvs)
