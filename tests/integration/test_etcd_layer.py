"""The thin etcd layer and the embedded server, against real etcd processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.connection import parse_endpoints
from coordinator.etcd.errors import EtcdUnavailable
from coordinator.etcd.server import EmbeddedEtcd, free_port
from coordinator.etcd.session import Session
from coordinator.etcd.txn import (
    Count,
    Delete,
    Empty,
    First,
    Get,
    Never,
    Put,
    ValueIs,
    When,
    prefix_end,
)
from coordinator.etcd.watch import WatchEvent
from tests.support.processes import unreachable_etcd
from tests.support.wait import wait_until


def test_keys_live_under_the_namespace(etcd: Etcd) -> None:
    etcd.put(etcd.key("a", 1), "x")
    assert etcd.key("a", 1) == f"{etcd.namespace}/a/1"
    assert etcd.get(etcd.key("a", 1)).value == b"x"  # type: ignore[union-attr]
    assert etcd.count_prefix(etcd.namespace + "/") == 1


def test_create_is_create_if_absent_and_safe_to_retry(etcd: Etcd) -> None:
    key = etcd.key("claim")
    created, kv, count = etcd.create(key, "me", count_prefix=etcd.namespace + "/")
    assert created and kv.value == b"me" and count == 1
    again, kv2, _ = etcd.create(key, "me")  # a retry after a lost answer: still ours
    assert again and kv2.create_revision == kv.create_revision
    other, kv3, _ = etcd.create(key, "someone else")
    assert not other and kv3.value == b"me"


def test_count_by_create_revision_counts_only_earlier_keys(etcd: Etcd) -> None:
    revisions = [etcd.put(etcd.key("arrivals", i), "") for i in range(5)]
    prefix = etcd.key("arrivals") + "/"
    assert [etcd.count_prefix(prefix, max_create_revision=r - 1) for r in revisions] == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_put_and_count_is_one_transaction(etcd: Etcd) -> None:
    prefix = etcd.key("b") + "/"
    answers = [etcd.put_and_count(prefix + str(i), "", 0, prefix) for i in range(3)]
    assert [answer.count for answer in answers] == [1, 2, 3]
    assert answers[-1].revision == etcd.get(prefix + "2").mod_revision  # type: ignore[union-attr]


def test_counts_are_answered_in_order_for_the_branch_that_ran(etcd: Etcd) -> None:
    """A transaction's counts and reads come apart, in order, from the branch that ran;
    counts alone are read without a transaction, at one revision."""
    a, b = etcd.key("ca") + "/", etcd.key("cb") + "/"
    for key in (a + "1", a + "2", b + "1"):
        etcd.put(key, "x")
    alone = etcd.transaction([Count(a), Get(b + "1"), Count(b)])
    assert alone.counts == [2, 1] and [kv and kv.key for kv in alone.reads] == [b + "1"]
    ran = etcd.transaction(
        [Put(a + "3", "y"), Count(a)], when=[Empty(b, prefix_end(b))], otherwise=[Count(b)]
    )
    assert not ran.succeeded and ran.counts == [1] and ran.reads == []
    ran = etcd.transaction([Put(b + "2", "y"), Count(b)], when=[Never(b + "none")])
    assert not ran.succeeded and ran.counts == [] and etcd.get(b + "2") is None


def test_transaction_runs_its_ops_only_when_the_ranges_are_empty(etcd: Etcd) -> None:
    """The step barrier's test: "am I alone at the lowest level?" as empty key ranges."""
    prefix = etcd.key("order") + "/"
    etcd.put(prefix + "2/a", "x")
    lowest = First(prefix, prefix_end(prefix))
    below_2 = [Empty(prefix, (prefix + "2/").encode())]
    moved = etcd.transaction(
        [Delete(prefix + "2/a"), Put(prefix + "3/a", "y"), lowest, Get(prefix + "none")],
        when=below_2,
    )
    assert moved.succeeded and [kv and kv.key for kv in moved.reads] == [prefix + "3/a", None]
    etcd.put(prefix + "1/b", "z")
    other = etcd.transaction([Put(etcd.key("raised"), "1")], when=below_2, otherwise=[lowest])
    assert not other.succeeded and other.reads[0] is not None
    assert other.reads[0].key == prefix + "1/b" and etcd.get(etcd.key("raised")) is None


def test_when_runs_its_puts_only_if_every_condition_holds(etcd: Etcd) -> None:
    """pBSP's wake-up: a nested put, conditional on other workers' fixed-width clocks."""
    at, mail = etcd.key("at") + "/", etcd.key("mail") + "/"
    for name, value in (("a", "000000000012"), ("b", "000000000009"), ("done", "999999999999")):
        etcd.put(at + name, value)

    def wake(to: str, *others: str) -> When:
        above = [ValueIs(at + name, ">", "000000000008") for name in (to, *others)]
        return When((*above, ValueIs(at + to, "<", "999999999999")), (Put(mail + to, "x"),))

    result = etcd.transaction(
        [
            Put(at + "b", "000000000010"),  # conditions see the store before this put
            wake("a", "b", "done"),  # woken: all above 8 (a finished one counts)
            wake("b", "a"),
            wake("done", "a"),  # not woken: finished
            wake("none", "a"),  # not woken: a missing key fails its condition
            Get(at + "b"),
        ]
    )
    assert [kv and kv.value for kv in result.reads] == [b"000000000010"]
    assert [kv.key for kv in etcd.get_prefix(mail)[0]] == [mail + "a", mail + "b"]
    exactly = When((ValueIs(at + "b", "=", "000000000010"),), (Put(mail + "c", "x"),))
    etcd.transaction([exactly, When((ValueIs(at + "b", "=", "10"),), (Put(mail + "d", "x"),))])
    assert [kv.key for kv in etcd.get_prefix(mail)[0]][2:] == [mail + "c"]
    etcd.delete(mail + "a")
    etcd.transaction([wake("a", "missing")])
    assert etcd.get(mail + "a") is None


def test_watch_resumes_after_an_etcd_restart_without_losing_events(tmp_path: Path) -> None:
    with (
        EmbeddedEtcd(data_dir=tmp_path / "etcd", auth=False) as server,
        Etcd(server.endpoint, security=server.security) as etcd,
    ):
        seen: list[WatchEvent] = []
        lock = threading.Lock()

        def collect(events: list[WatchEvent]) -> None:
            with lock:
                seen.extend(events)

        start = etcd.put(etcd.key("w", 0), "0")
        watch = etcd.watch(etcd.key("w") + "/", collect, start_revision=start, prefix=True)
        wait_until(lambda: len(seen) == 1, 10, "the first event")
        server.stop()
        server.start()
        # Written while the watcher reconnects.
        with Etcd(server.endpoint, security=server.security) as writer:
            for i in range(1, 4):
                writer.put(writer.key("w", i), str(i))
        wait_until(lambda: len(seen) == 4, 20, "all four events after the restart")
        watch.cancel()
        assert [e.value for e in seen] == [b"0", b"1", b"2", b"3"]
        assert [e.kind for e in seen] == ["put"] * 4


def test_an_embedded_etcds_data_and_log_are_private(tmp_path: Path) -> None:
    with EmbeddedEtcd(tmp_path / "etcd") as server:
        assert server.log_path.exists()
        assert stat.S_IMODE(server.log_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(server.data_dir.stat().st_mode) == 0o700


def test_only_deletes_watch_carries_the_previous_value(etcd: Etcd) -> None:
    seen: list[WatchEvent] = []
    revision = etcd.put(etcd.key("m", 1), "state")
    watch = etcd.watch(
        etcd.key("m") + "/", seen.extend, revision + 1, prefix=True, only_deletes=True
    )
    etcd.put(etcd.key("m", 2), "ignored")
    etcd.delete(etcd.key("m", 1))
    wait_until(lambda: seen, 10, "the deletion")
    watch.cancel()
    assert [(e.kind, e.prev_value) for e in seen] == [("delete", b"state")]


def test_session_keys_vanish_with_the_session(etcd: Etcd) -> None:
    session = Session(etcd, ttl=2)
    etcd.put(etcd.key("s"), "x", session.lease_id)
    session.close(revoke=True)
    assert etcd.get(etcd.key("s")) is None


def test_session_is_kept_alive_past_its_ttl_and_reports_loss(etcd: Etcd) -> None:
    session = Session(etcd, ttl=2)
    etcd.put(etcd.key("s"), "x", session.lease_id)
    reasons: list[str] = []
    session.on_lost(reasons.append)
    started = time.monotonic()
    wait_until(lambda: time.monotonic() - started > 3, 5, "a time past the ttl")
    assert etcd.get(etcd.key("s")) is not None, "keepalive must hold the lease past its TTL"
    etcd.revoke_lease(session.lease_id)
    wait_until(lambda: session.lost.is_set(), 5, "the session to notice its lease is gone")
    assert reasons and "expired" in reasons[0]
    session.close()


def test_unreachable_etcd_fails_within_the_connect_timeout() -> None:
    endpoint = unreachable_etcd(free_port())
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable, match=f"cannot reach etcd at {endpoint} within 0.5s"):
        Etcd(endpoint, connect_timeout=0.5)
    assert time.monotonic() - started < 3


def test_a_second_endpoint_is_used_when_the_first_is_down(etcd_server: EmbeddedEtcd) -> None:
    dead = unreachable_etcd(free_port())
    with Etcd([dead, etcd_server.endpoint], connect_timeout=5) as etcd:
        assert etcd.put(etcd.key("failover"), "ok") > 0
        etcd.delete(etcd.key("failover"))


@pytest.mark.parametrize(
    ("given", "message"),
    [("", "no etcd endpoint"), ("nohost", "is not HOST:PORT"), ("https://a:1,b:2", "mix https")],
)
def test_bad_endpoints_are_named(given: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_endpoints(given)


def test_endpoint_forms_are_normalised() -> None:
    assert parse_endpoints("http://a:1/, b:2") == ["a:1", "b:2"]


def test_embedded_etcd_keeps_its_data_across_a_restart(tmp_path: Path) -> None:
    with EmbeddedEtcd(data_dir=tmp_path / "d", auth=False) as server:
        with Etcd(server.endpoint, security=server.security) as etcd:
            etcd.put("/k", "v")
        server.stop()
        assert server.process is None
        server.start()
        with Etcd(server.endpoint, security=server.security) as etcd:
            assert etcd.get("/k").value == b"v"  # type: ignore[union-attr]
    assert (tmp_path / "d").exists(), "a caller's data dir is the caller's to remove"


def test_embedded_etcd_removes_its_own_data_dir() -> None:
    server = EmbeddedEtcd().start()
    data_dir, pid = server.data_dir, server.process.pid  # type: ignore[union-attr]
    server.close()
    assert not data_dir.exists()
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)


OWNER_OF_AN_ETCD = """
import sys, time
from coordinator.etcd.server import EmbeddedEtcd
server = EmbeddedEtcd(data_dir=sys.argv[1], auth=False).start()
print(server.process.pid, flush=True)
time.sleep(600)  # until the test kills it: no cleanup of ours runs
"""


def _alive(pid: int) -> bool:
    """Running (a zombie is not: it waits only for its parent to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_an_embedded_etcd_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """SIGKILL skips every cleanup of the owner's: the kernel still stops its etcd."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_OF_AN_ETCD, str(tmp_path / "etcd")],
        stdout=subprocess.PIPE,
        text=True,
    )
    etcd_pid = 0
    try:
        assert owner.stdout is not None
        etcd_pid = int(owner.stdout.readline())
        assert _alive(etcd_pid) and Path(f"/proc/{etcd_pid}/exe").resolve().name == "etcd"
        owner.kill()
        owner.wait(timeout=10)
        wait_until(lambda: not _alive(etcd_pid), 10, "the orphaned etcd to be killed")
    finally:
        owner.kill()
        owner.wait(timeout=10)
        if etcd_pid and _alive(etcd_pid):
            os.kill(etcd_pid, 9)


CALL_AFTER_MOVE = """
import sys
from pyetcd import etcdrpc
from coordinator.etcd.client import Etcd
etcd = Etcd(sys.argv[1:])  # the same member twice: a move changes the connection only
kv, watcher = etcd._kv(), etcd._watcher()
etcd._rotate(etcd._generation)  # as another thread failing over would
kv.Range(etcdrpc.RangeRequest(key=b"/x"), timeout=5)  # took the old one just before
watcher.add_callback(b"/x", lambda response: None)
etcd.close()
kv.Range(etcdrpc.RangeRequest(key=b"/x"), timeout=5)
print("alive")
"""


def test_a_call_on_the_connection_a_client_just_left_still_runs(
    etcd_server: EmbeddedEtcd,
) -> None:
    """gRPC kills the process (SIGSEGV) when a call starts through a closed authenticating
    channel: a connection the client moved away from, or closed, stays open a while."""
    assert etcd_server.security.authenticates
    env = dict(os.environ)
    etcd_server.security.export(env)
    done = subprocess.run(
        [sys.executable, "-c", CALL_AFTER_MOVE, etcd_server.endpoint, etcd_server.endpoint],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and "alive" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_a_closed_clients_watches_end_with_it(etcd_server: EmbeddedEtcd) -> None:
    """A watch still open when its client closes must not try to resume for ever (it
    would spin a core on 'client is closed')."""
    client = Etcd(etcd_server.endpoint, security=etcd_server.security)
    client.watch(client.key("closing"), lambda events: None, start_revision=0)
    stream = client._watcher()._callback_thread
    assert stream is not None and stream.is_alive()
    client.close()
    stream.join(10)
    assert not stream.is_alive(), "the watch stream ends with its client"
    # (its end was told to the watch before the thread ended: a resume would be running)
    assert not [t for t in threading.enumerate() if t.name == "etcd-watch-resume"]


def test_reads_alone_are_read_at_one_revision_without_a_transaction(etcd: Etcd) -> None:
    """A read-only transaction that runs out of time crashes etcd before 3.5.5 (etcd#14110):
    reads alone go as ranges, all at the first one's revision, as a transaction reads."""
    first = etcd.put(etcd.key("snap", "a"), "1")
    etcd.put(etcd.key("snap", "b"), "2")
    before = etcd.operations
    result = etcd.transaction(
        [
            Get(etcd.key("snap", "a")),
            First(etcd.key("snap", "b"), prefix_end(etcd.key("snap", "b"))),
            Get(etcd.key("snap", "none")),
        ]
    )
    assert etcd.operations - before == 3  # three ranges, not one transaction
    assert result.succeeded and result.revision >= first
    assert [kv.value if kv else None for kv in result.reads] == [b"1", b"2", None]
    assert all(kv is None or kv.mod_revision <= result.revision for kv in result.reads)


def test_a_watch_whose_creation_timed_out_gets_a_new_stream(etcd: Etcd) -> None:
    """The library pairs watch creations with etcd's answers by order: the late answer
    to a creation that timed out would be taken for the next one's, which then gets
    another watch's events and never its own. The client moves to a new stream."""
    stale = etcd._watcher()
    stale.timeout = 0  # its next creation times out before etcd can answer
    first: list[str] = []
    second: list[str] = []
    a = etcd.watch(etcd.key("pair", "a"), lambda es: first.extend(e.key for e in es), 0)
    b = etcd.watch(etcd.key("pair", "b"), lambda es: second.extend(e.key for e in es), 0)
    assert etcd._watcher() is not stale
    etcd.put(etcd.key("pair", "a"), "1")
    etcd.put(etcd.key("pair", "b"), "2")
    wait_until(lambda: first and second, 10, "each watch to see its own put")
    assert first == [etcd.key("pair", "a")] and second == [etcd.key("pair", "b")]
    a.cancel()
    b.cancel()


def test_watch_cancels_never_wait_on_a_stream_that_stopped_reading(etcd: Etcd) -> None:
    """A stream whose thread is busy in a callback when its call ends reads none of the
    requests queued meanwhile. Cancelling many watches then must not wait: the library's
    bounded queue would hold its lock for ever, and every watch and keepalive with it."""
    busy, release = threading.Event(), threading.Event()

    def hold(events: list[WatchEvent]) -> None:
        busy.set()
        release.wait(30)

    holding = etcd.watch(etcd.key("stuck", "hold"), hold, 0)
    watches = [etcd.watch(etcd.key("stuck", str(i)), lambda es: None, 0) for i in range(12)]
    watcher = etcd._watcher()
    etcd.put(etcd.key("stuck", "hold"), "1")
    wait_until(busy.is_set, 10, "the stream's thread to be in the callback")
    assert watcher.stream is not None
    stream = watcher.stream()
    assert stream is not None
    stream.cancel()  # the call ends: nothing reads its requests any more
    cancelling = threading.Thread(target=lambda: [w.cancel() for w in watches], daemon=True)
    cancelling.start()
    cancelling.join(10)
    release.set()
    assert not cancelling.is_alive(), "a watch's cancel waited on the stopped stream"
    holding.cancel()


@pytest.mark.parametrize("stream", ["replaced", "restarted"])
def test_a_watch_cancelled_after_its_stream_ended_leaves_the_next_streams_watches(
    etcd: Etcd, stream: str
) -> None:
    """Watch ids count from 0 on every stream. A watch cancelled before it moved to the
    client's next stream (a new one, or the same one's next call) must not cancel
    another watch there that got its id: that one would never hear of its key again
    (a barrier waiting for ever)."""
    old = etcd.watch(etcd.key("ids", "old"), lambda events: None, 0)
    heard = threading.Event()
    with etcd._watch_lock:  # (the old watch cannot move to the next stream meanwhile)
        watcher = etcd._watcher()
        if stream == "replaced":
            etcd._renew_watcher(watcher)
        else:
            ended = watcher._callback_thread
            assert watcher.stream is not None and ended is not None
            watcher.stream().cancel()  # type: ignore[union-attr]
            ended.join(10)
        other = etcd._watcher().add_callback(
            etcd.key("ids", "other"), lambda response: heard.set(), start_revision=0
        )
        old.cancel()
    etcd.put(etcd.key("ids", "other"), "1")
    assert heard.wait(10), f"watch {other} on the next stream was cancelled with the old one"
