"""The `agents` launcher: gang placement on agents' slots, with a real etcd, real agents,
a real service and real members.

Placement itself is pure (`coordinator.service.placement.gang`) and tested on its own
first; then the transaction that guards it against a second replica; then the
whole path: jobs submitted over REST run on three agents, wait for room, and
survive an agent killed mid-job.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.session import Session
from coordinator.launch import WorkerCommand
from coordinator.service.launchers import Launch
from coordinator.service.model import JobSpec, JobState
from coordinator.service.placement.agents_launcher import AgentsLauncher
from coordinator.service.placement.gang import AgentRoom, capacity, place
from coordinator.service.states import advance
from coordinator.service.store import JobStore
from tests.support.agents import SlotWatch, register, registered
from tests.support.service import ServiceProc, wait_state
from tests.support.signing import session_signer
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd

# -- placement (pure) --------------------------------------------------------------------


def test_members_spread_over_the_freest_agents_and_a_job_is_placed_whole_or_not_at_all() -> None:
    rooms = [AgentRoom("a", 2), AgentRoom("b", 2, used=1), AgentRoom("c", 3)]
    assert placed_on(place(rooms, 3, {})) == ["c", "a", "c"]  # most free first, ties by id
    assert place(rooms, 6, {}) is not None
    assert place(rooms, 7, {}) is None  # 6 free: nothing is placed
    assert place([AgentRoom("full", 2, used=2)], 1, {}) is None


def test_labels_narrow_the_agents_a_job_may_use() -> None:
    rooms = [AgentRoom("cpu", 4, labels={"zone": "a"}), AgentRoom("gpu", 1, labels={"gpu": "1"})]
    assert placed_on(place(rooms, 1, {"gpu": "1"})) == ["gpu"]
    assert place(rooms, 2, {"gpu": "1"}) is None
    assert capacity(rooms, {"zone": "a"}) == 4 and capacity(rooms, {"zone": "b"}) == 0


def placed_on(placed: list[tuple[str, tuple[int, ...]]] | None) -> list[str] | None:
    return None if placed is None else [agent_id for agent_id, _ in placed]


# -- the guarded transaction ------------------------------------------------------------


def test_two_replicas_placing_from_the_same_view_never_over_fill_an_agent(etcd: Etcd) -> None:
    """Both read one free agent with 2 slots; the second commit finds it changed."""
    session = Session(etcd, 10)
    try:
        register(etcd, "only", 2, session)
        store = JobStore(etcd, session_signer())
        launcher = AgentsLauncher(etcd, session_signer())
        records = [
            store.submit(JobSpec(id=f"race-{n}", kind="noop", workers=2), time.time())[0]
            for n in range(2)
        ]
        launches = [
            Launch(r.run_id, 1, r.spec, WorkerCommand(job_id=r.id, world_size=2)) for r in records
        ]
        reservations = [launcher.reserve(launch) for launch in launches]  # the same view
        assert all(r is not None and len(r.members) == 2 for r in reservations)

        def starting(record: Any) -> Any:
            return advance(record, JobState.STARTING, "test", time.time())

        outcomes = []
        for record, reservation in zip(records, reservations, strict=True):
            assert reservation is not None
            updated = store.update(record.id, starting, reservation.guards, reservation.puts)
            outcomes.append(updated.state)
        assert outcomes == [JobState.STARTING, JobState.PENDING]
        assigned, _ = etcd.get_prefix(etcd.key("assignments", "only") + "/")
        assert len(assigned) == 2
        assert all(kv.lease == session.lease_id for kv in assigned)  # they die with it
        assert launcher.reserve(launches[1]) is None  # and from a fresh view: no room
    finally:
        session.close(revoke=True)


# -- the whole path ----------------------------------------------------------------------


def three_agents(agents: Any, etcd: Etcd) -> list[Any]:
    started = [agents("--id", f"agent-{n}", "--slots", "2") for n in range(3)]
    for n in range(3):
        wait_until(lambda n=n: registered(etcd, f"agent-{n}"), 30, f"agent-{n} to register")
    return started


def test_jobs_share_three_agents_wait_for_room_and_never_over_fill_one(
    serve: Callable[..., ServiceProc],
    agents: Any,
    etcd: Etcd,
    slots: SlotWatch,
) -> None:
    three_agents(agents, etcd)
    service = serve("--default-launcher", "agents")
    never = service.http.post("/v1/jobs", json={"kind": "noop", "workers": 7})
    assert never.status_code == 422
    assert "6 slots" in never.json()["detail"][0]["msg"]

    jobs = {
        "boost": {"kind": "xgboost", "workers": 3,
                  "params": {"rounds": 30, "data": "synthetic:50000x20"}},
        "paced": {"kind": "steps", "workers": 3,
                  "params": {"method": "bsp", "num_steps": 30, "step_seconds": 0.1}},
        "waits": {"kind": "noop", "workers": 4},
    }  # fmt: skip
    for job_id, spec in jobs.items():
        response = service.http.post("/v1/jobs", json={"id": job_id, **spec})
        assert response.status_code == 201, response.text
        assert response.json()["spec"]["launcher"] == "agents"  # the service's default

    records = {j: wait_state(service, j, {"SUCCEEDED", "FAILED"}, timeout=180) for j in jobs}
    for job_id, record in records.items():
        assert record["state"] == "SUCCEEDED", (job_id, record["conditions"][-1])
    # The 4-worker job waited in PENDING until a member of the others ended: 6 slots held
    # by two 3-worker jobs leave it no room before.
    first_end = min(at for name, at in slots.exits.items() if not name.startswith("waits-"))
    waits = records["waits"]["conditions"]
    assert waits[0]["state"] == "PENDING"
    started = next(c["at"] for c in waits if c["state"] == "STARTING")
    assert started >= first_end, (started, first_end)
    both = [records[j]["conditions"] for j in ("boost", "paced")]
    assert all(next(c["at"] for c in c_ if c["state"] == "STARTING") < started for c_ in both)
    placed = [m["assignment"].split("/")[0] for m in records["boost"]["attempts"][0]["members"]]
    assert sorted(placed) == ["agent-0", "agent-1", "agent-2"]  # spread, one per agent

    logs = service.http.get("/v1/jobs/boost/logs", params={"rank": 0}).text
    assert '"event": "done"' in logs  # output from the agent's host, through the service
    assert len(slots.started) == 10  # every member ran, each once
    assert max(slots.most.values()) <= 2, slots.most


@pytest.mark.slow  # ~14 s: the default suite is at its budget
def test_an_agent_killed_mid_job_restarts_the_job_on_the_others(
    serve: Callable[..., ServiceProc],
    agents: Any,
    etcd: Etcd,
    slots: SlotWatch,
) -> None:
    started = three_agents(agents, etcd)
    service = serve("--default-launcher", "agents")
    spec = {"id": "survivor", "kind": "noop", "workers": 3, "params": {"seconds": 6},
            "max_restarts": 1}  # fmt: skip
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    running = wait_state(service, "survivor", {"RUNNING"}, timeout=60)
    victim = running["attempts"][0]["members"][1]["assignment"].split("/")[0]
    started[int(victim.rsplit("-", 1)[1])].process.send_signal(signal.SIGKILL)
    orphans = slots.pids[victim]
    # At once (their job holds them 6 s): the kernel kills them with the agent.
    wait_until(lambda: not any(_alive(pid) for pid in orphans), 3, "its members to die with it")

    record = wait_state(service, "survivor", {"SUCCEEDED", "FAILED"}, timeout=120)
    assert record["state"] == "SUCCEEDED", record["conditions"]
    assert [c["state"] for c in record["conditions"]].count("RESTARTING") == 1
    second = {m["assignment"].split("/")[0] for m in record["attempts"][1]["members"]}
    assert victim not in second and len(second) == 2  # the live agents, and only them
    assert max(slots.most.values()) <= 2, slots.most


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
