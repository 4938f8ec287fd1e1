"""A placement too big for one etcd transaction: written ahead in chunks, committed by
one key with the job's move to STARTING, started by agents only once committed, and
swept when never committed.

The cutting is pure (`coordinator.service.placement.chunks`) and tested first; then the
launcher's writes on a real etcd (one that refuses the single big transaction too);
then the whole path: real agents, a real service, real members.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.security import ENV
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.etcd.session import Session
from coordinator.etcd.txn import CreatedAt, QuietSince
from coordinator.etcd.watch import WatchEvent
from coordinator.keys import Keys, placements_of
from coordinator.launch import WorkerCommand
from coordinator.service.launchers import Launch
from coordinator.service.model import JobSpec, JobState
from coordinator.service.placement.agents_launcher import AgentsLauncher
from coordinator.service.placement.chunks import (
    Write,
    check_limits,
    chunk_guards,
    chunks,
    fits_one_transaction,
)
from coordinator.service.runner import Service, ServiceOptions
from coordinator.service.states import advance
from coordinator.service.store import JobStore
from tests.support.agents import SlotWatch, register, registered
from tests.support.service import ServiceProc, wait_state
from tests.support.signing import session_signer
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd

# -- cutting a placement (pure) -----------------------------------------------------------


def _writes(per_agent: dict[str, int], size: int = 10) -> list[Write]:
    return [
        Write(agent, f"k/{agent}/{n}", b"v" * size)
        for agent, count in per_agent.items()
        for n in range(count)
    ]


def test_a_placement_that_fits_stays_one_transaction_with_the_starting_ones_own() -> None:
    assert fits_one_transaction(_writes({"a": 49, "b": 49}), 100, 10**6)  # 98 + 2 ops
    assert not fits_one_transaction(_writes({"a": 50, "b": 49}), 100, 10**6)
    # 50 agents of one member: 100 guards and 2 of the record's: too many conditions.
    assert fits_one_transaction(_writes({f"h{n}": 1 for n in range(49)}), 100, 10**6)
    assert not fits_one_transaction(_writes({f"h{n}": 1 for n in range(50)}), 100, 10**6)
    assert not fits_one_transaction(_writes({"a": 3}, size=400), 100, 1000)  # bytes


def test_chunks_group_by_agent_and_keep_ops_conditions_and_bytes_within_the_limits() -> None:
    writes = _writes({"c": 4, "a": 3, "b": 3, "d": 1, "e": 1, "f": 1})
    cut = chunks(writes, 6, 10**6)
    assert sorted(w.key for chunk in cut for w in chunk) == sorted(w.key for w in writes)
    for chunk in cut:
        ids = [w.agent_id for w in chunk]
        assert len(chunk) <= 6 and 2 * len(set(ids)) <= 6
        assert ids == sorted(ids)  # grouped by agent
        for agent in set(ids):  # each agent's members in their order
            mine = [w.key for w in chunk if w.agent_id == agent]
            assert mine == sorted(mine)
    assert [len(c) for c in cut] == [6, 6, 1]  # a a a b b b | c c c c d e | f
    # a a a b | b b c c | c c d | e f: at most 2 agents (4 guards) each
    assert [len(c) for c in chunks(writes, 4, 10**6)] == [4, 4, 3, 2]
    big = chunks(_writes({"a": 5}, size=400), 100, 1000)
    assert [len(c) for c in big] == [2, 2, 1]
    alone = chunks([Write("a", "k", b"x" * 5000), *_writes({"a": 1})], 100, 1000)
    assert [len(c) for c in alone] == [1, 1]  # a write over the budget goes alone


def test_a_chunk_is_guarded_by_each_of_its_agents_registration_and_assignments() -> None:
    chunk = _writes({"a": 2, "b": 1})
    registrations = {"a": CreatedAt("reg/a", 5), "b": CreatedAt("reg/b", 6)}
    prefixes = {"a": "asg/a/", "b": "asg/b/"}
    guards = chunk_guards(chunk, registrations, prefixes, {"a": 40, "b": 41})
    assert guards == [
        CreatedAt("reg/a", 5),
        QuietSince("asg/a/", 40),
        CreatedAt("reg/b", 6),
        QuietSince("asg/b/", 41),
    ]


def test_limits_no_placement_fits_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="max_txn_ops"):
        check_limits(3, 10**6)
    with pytest.raises(ValueError, match="max_txn_bytes"):
        check_limits(100, 0)


def test_a_runs_placements_are_named_exactly() -> None:
    token = "0123456789abcdef"
    assert placements_of("job-0a1b2c3d", 1).fullmatch(f"job-0a1b2c3d-a1-{token}")
    assert not placements_of("job-0a1b2c3d", 1).fullmatch(f"job-0a1b2c3d-a12-{token}")
    assert placements_of("job-0a1b2c3d").fullmatch(f"job-0a1b2c3d-a12-{token}")
    # Another job whose id starts with this run's: never this run's.
    other = f"job-0a1b2c3d-a1-x-0a1b2c3d-a1-{token}"
    assert not placements_of("job-0a1b2c3d").fullmatch(other)


# -- the launcher's writes on a real etcd ------------------------------------------------------


def _launch(etcd: Etcd, job_id: str, workers: int, run_id: str | None = None) -> Launch:
    spec = JobSpec(id=job_id, kind="noop", workers=workers)
    command = WorkerCommand(job_id=job_id, world_size=workers, namespace=etcd.namespace)
    return Launch(run_id or f"{job_id}-0a1b2c3d", 1, spec, command)


def _assigned(etcd: Etcd) -> list[dict[str, Any]]:
    kvs, _ = etcd.get_prefix(etcd.key("assignments") + "/")
    return [json.loads(kv.value) for kv in kvs]


def _starting(record: Any) -> Any:
    return advance(record, JobState.STARTING, "test", time.time())


@pytest.fixture
def two_fake_agents(etcd: Etcd) -> Iterator[Session]:
    """Two registrations of 6 slots under one lease (no agent process: nothing runs)."""
    session = Session(etcd, 10)
    register(etcd, "fake-a", 6, session)
    register(etcd, "fake-b", 6, session)
    yield session
    session.close(revoke=True)


def test_a_release_withdraws_an_uncommitted_placement_but_never_a_committed_one(
    etcd: Etcd, two_fake_agents: Session
) -> None:
    store = JobStore(etcd, session_signer())
    record = store.submit(JobSpec(id="big", kind="noop", workers=10), time.time())[0]
    launcher = AgentsLauncher(etcd, session_signer(), max_txn_ops=6)
    launch = _launch(etcd, "big", 10, record.run_id)

    first = launcher.reserve(launch)
    assert first is not None and len(first.members) == 10
    assert len(first.puts) == 1 and not first.guards  # only the commit is left to write
    assigned = _assigned(etcd)
    assert len(assigned) == 10 and len({a["placement"] for a in assigned}) == 1
    assert all(kv.lease == two_fake_agents.lease_id for kv in etcd.get_prefix(
        etcd.key("assignments") + "/")[0])  # fmt: skip
    assert launcher.reserve(launch) is None  # its own pending assignments hold the slots
    assert first.release is not None
    first.release()
    assert _assigned(etcd) == []  # withdrawn at once: no commit was made

    second = launcher.reserve(launch)
    assert second is not None and second.release is not None
    placement = _assigned(etcd)[0]["placement"]
    assert placement != assigned[0]["placement"]  # a new id for each try
    started = store.update(record.id, _starting, second.guards, second.puts)
    assert started.state == JobState.STARTING
    assert etcd.get(Keys(etcd.namespace).placement(placement)) is not None
    second.release()  # committed: nothing goes
    assert len(_assigned(etcd)) == 10
    launcher.placement_ended(record.run_id, 1)
    assert etcd.get(Keys(etcd.namespace).placement(placement)) is None


def test_an_etcd_that_refuses_the_one_big_transaction_takes_the_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd with --max-txn-ops 8: the single transaction of a 10-member placement is
    refused; the chunked one is written and committed."""
    with EmbeddedEtcd(extra_args=["--max-txn-ops", "8"]) as server:
        settings: dict[str, str] = {}
        server.security.export(settings)
        for var in ENV.values():  # setenv, not delenv: only setenv undoes what it adds
            if var in settings:
                monkeypatch.setenv(var, settings[var])
            else:
                monkeypatch.delenv(var, raising=False)
        with Etcd(server.endpoint, namespace="/small") as etcd:
            session = Session(etcd, 10)
            try:
                register(etcd, "fake-a", 6, session)
                register(etcd, "fake-b", 6, session)
                store = JobStore(etcd, session_signer())
                record = store.submit(JobSpec(id="big", kind="noop", workers=10), time.time())[0]
                launch = _launch(etcd, "big", 10, record.run_id)
                whole = AgentsLauncher(etcd, session_signer(), max_txn_ops=1000).reserve(launch)
                assert whole is not None and len(whole.puts) == 10
                with pytest.raises(EtcdError, match="too many operations"):
                    store.update(record.id, _starting, whole.guards, whole.puts)
                assert _assigned(etcd) == []

                chunked = AgentsLauncher(etcd, session_signer(), max_txn_ops=8).reserve(launch)
                assert chunked is not None
                started = store.update(record.id, _starting, chunked.guards, chunked.puts)
                assert started.state == JobState.STARTING
                assigned = _assigned(etcd)
                assert sorted(a["index"] for a in assigned) == list(range(10))
                commit = Keys(etcd.namespace).placement(assigned[0]["placement"])
                assert etcd.get(commit) is not None
            finally:
                session.close(revoke=True)


# -- the whole path ------------------------------------------------------------------------


class PlacementWatch:
    """The placements every assignment named, as written (from a watch of them all)."""

    def __init__(self, etcd: Etcd) -> None:
        self.placements: dict[str, str | None] = {}  # member -> its placement
        self._lock = threading.Lock()
        prefix = etcd.key("assignments") + "/"
        self._watch = etcd.watch(prefix, self._on, start_revision=0, prefix=True)

    def _on(self, events: list[WatchEvent]) -> None:
        with self._lock:
            for event in events:
                if event.kind == "put":
                    value = json.loads(event.value)
                    self.placements[event.key.rpartition("/")[2]] = value.get("placement")

    def close(self) -> None:
        self._watch.cancel()


def three_agents(start: Any, etcd: Etcd, *options: str) -> None:
    """Agents agent-0..2 with these options, registered."""
    for n in range(3):
        start("--id", f"agent-{n}", *options)
    for n in range(3):
        wait_until(lambda n=n: registered(etcd, f"agent-{n}"), 30, f"agent-{n} to register")


def _nothing_left(etcd: Etcd) -> bool:
    for what in ("assignments", "placements"):
        if etcd.count_prefix(etcd.key(what) + "/"):
            return False
    return True


def test_a_job_bigger_than_one_transaction_runs_whole_and_leaves_nothing(
    serve: Callable[..., ServiceProc],
    agents: Any,
    etcd: Etcd,
    slots: SlotWatch,
) -> None:
    three_agents(agents, etcd, "--slots", "4")
    watch = PlacementWatch(etcd)
    try:
        service = serve("--default-launcher", "agents", "--max-txn-ops", "6")
        response = service.http.post("/v1/jobs", json={"id": "wide", "kind": "noop", "workers": 10})
        assert response.status_code == 201, response.text
        record = wait_state(service, "wide", {"SUCCEEDED", "FAILED"}, timeout=120)
        assert record["state"] == "SUCCEEDED", record["conditions"]
        assert len(record["attempts"]) == 1
        names = {m["assignment"].split("/")[1] for m in record["attempts"][0]["members"]}
        assert len(names) == 10 and all("-a1-m" in name for name in names)
        assert slots.started == names  # every member ran, each once (attempt 1 only)
        assert max(slots.most.values()) <= 4, slots.most
        placements = {watch.placements[name] for name in names}
        assert len(placements) == 1 and None not in placements  # written ahead, one commit
        wait_until(lambda: _nothing_left(etcd), 30, "no assignment or commit to be left")
    finally:
        watch.close()


@pytest.fixture
def service_in_process(
    etcd_server: EmbeddedEtcd, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Service]]:
    """A service in this process (no HTTP): its reconciler, with settings tests lower."""
    started: list[Service] = []
    # A Service sets the members' default artifacts folder in its process's environment:
    # here the test's, restored after it (later tests would write their artifacts there).
    monkeypatch.setenv("COORDINATOR_ARTIFACTS", str(tmp_path / "artifacts"))

    def start(**settings: Any) -> Service:
        options = ServiceOptions(
            etcd=etcd_server.endpoint,
            namespace=namespace,
            data_dir=tmp_path / "service",
            max_workers=2,
            **settings,
        )
        service = Service(options)
        started.append(service)
        service.start()
        return service

    yield start
    for service in started:
        service.stop()


def test_a_placement_never_committed_starts_nothing_and_is_swept(
    service_in_process: Callable[..., Service],
    agents: Any,
    etcd: Etcd,
    slots: SlotWatch,
    tmp_path: Path,
) -> None:
    """A writer that wrote its chunks and died before its commit: the agents start none
    of it, and the leader removes its assignments after the grace (2 s here)."""
    for n in range(2):
        agents("--id", f"agent-{n}", "--slots", "5")
    for n in range(2):
        wait_until(lambda n=n: registered(etcd, f"agent-{n}"), 30, f"agent-{n} to register")
    service_in_process(placement_grace=2.0)
    launcher = AgentsLauncher(etcd, session_signer(), max_txn_ops=6)
    launch = _launch(etcd, "ghost", 10)
    reservation = launcher.reserve(launch)  # and then no commit, no release: it "died"
    assert reservation is not None
    written = time.monotonic()
    assert len(_assigned(etcd)) == 10
    wait_until(lambda: not _assigned(etcd), 30, "the sweep to remove the assignments")
    assert time.monotonic() - written >= 2.0  # not before the grace
    # The agents had those seconds to start something: nothing ran, nothing reported.
    assert slots.started == set() and slots.states == {}
    assert not list(tmp_path.rglob("member-*"))  # no member's log or pidfile
    # The slots are free again for a placement that is committed.
    again = launcher.reserve(launch)
    assert again is not None and again.release is not None
    again.release()
    assert _assigned(etcd) == []


@pytest.mark.slow  # 90-300 s: 150 member processes on a 2-core machine, each importing ~1 s
@pytest.mark.timeout(900)
def test_a_job_of_150_workers_places_on_three_agents_with_the_default_limit(
    serve: Callable[..., ServiceProc],
    agents: Any,
    etcd: Etcd,
    slots: SlotWatch,
) -> None:
    # Leases of 30 s (the fixtures' 2 s are for tests that kill things): 150 members
    # starting at once load the machine far beyond its 2 cores (with 10 s, a member once
    # lost its lease there: exit 7).
    three_agents(agents, etcd, "--slots", "50", "--ttl", "30")
    # (and 60 s to reach etcd, which those 150 starting processes starve of CPU)
    service = serve(
        "--default-launcher", "agents", "--member-ttl", "30", "--member-connect-timeout", "60"
    )
    response = service.http.post("/v1/jobs", json={"id": "many", "kind": "noop", "workers": 150})
    assert response.status_code == 201, response.text
    record = wait_state(service, "many", {"SUCCEEDED", "FAILED"}, timeout=600)
    assert record["state"] == "SUCCEEDED", record["conditions"]
    assert len(record["attempts"]) == 1 and len(slots.started) == 150
    wait_until(lambda: _nothing_left(etcd), 60, "no assignment or commit to be left")
