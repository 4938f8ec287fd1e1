"""The agent with a real etcd and real member processes: registration, assignments, drain."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from tests.support.agents import AgentProc, as_the_service, registered
from tests.support.etcd_cluster import CuttableProxy
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd


def assign(
    etcd: Etcd, agent_id: str, name: str, args: list[str], placement: str | None = None
) -> None:
    run_id, attempt, index = name.rsplit("-a", 1)[0], 1, int(name.rsplit("-m", 1)[1])
    body: dict[str, Any] = {"run_id": run_id, "attempt": attempt, "index": index,
                            "worker_args": args}  # fmt: skip
    if placement is not None:
        body["placement"] = placement
    etcd.put(etcd.key("assignments", agent_id, name), as_the_service(etcd, agent_id, body))


def test_an_agent_registers_and_a_second_with_its_id_is_refused(agents: Any, etcd: Etcd) -> None:
    first = agents("--id", "host-a", "--slots", "3", "--label", "zone=z1")
    record = wait_until(lambda: registered(etcd, "host-a"), 30, "the agent to register")
    assert record["slots"] == 3 and record["labels"] == {"zone": "z1"}
    second = agents("--id", "host-a")
    assert second.process.wait(30) == 2
    assert b"registered by another live agent" in second.process.communicate()[1]
    assert registered(etcd, "host-a")["pid"] == first.process.pid  # type: ignore[index]


def test_two_agents_starting_at_once_with_one_id_never_share_it(agents: Any, etcd: Etcd) -> None:
    pair = [agents("--id", "twin"), agents("--id", "twin")]
    refused = wait_until(
        lambda: next((a for a in pair if a.process.poll() is not None), None),
        30,
        "one of the two to be refused",
    )
    assert refused.process.returncode == 2
    assert b"registered by another live agent" in refused.process.communicate()[1]
    (winner,) = [a for a in pair if a is not refused]
    record = wait_until(lambda: registered(etcd, "twin"), 30, "the other to register")
    assert record["pid"] == winner.process.pid and winner.process.poll() is None


def test_assigned_members_run_report_and_serve_their_output(
    agents: Any, etcd: Etcd, etcd_server: EmbeddedEtcd
) -> None:
    agent = agents("--id", "host-b", "--slots", "2")
    record = wait_until(lambda: registered(etcd, "host-b"), 30, "the agent to register")
    worker = ["--job", "viaagent", "--world-size", "2", "--etcd", etcd_server.endpoint,
              "--namespace", etcd.namespace]  # fmt: skip
    names = ["viaagent-0123-a1-m0", "viaagent-0123-a1-m1"]
    for name in names:
        assign(etcd, "host-b", name, worker)

    def reports() -> list[dict[str, Any]] | None:
        found = [etcd.get(etcd.key("reports", "host-b", name)) for name in names]
        states = [json.loads(kv.value) for kv in found if kv is not None]
        return states if len(states) == 2 and all(s["state"] == "exited" for s in states) else None

    states = wait_until(reports, 60, "both members to end")
    assert [s["exit_code"] for s in states] == [0, 0]
    url = f"http://{record['address']}/members/{names[1]}/output"
    bearer = {"Authorization": f"Bearer {record['token']}"}
    output = httpx.get(url, headers=bearer).content
    assert b'"event": "done"' in output
    tail = httpx.get(url + "?offset=10", headers=bearer).content
    assert tail == output[10:]
    nobody = f"http://{record['address']}/members/nobody/output"
    assert httpx.get(nobody, headers=bearer).status_code == 404
    # Without the token of its registration, or with another, it answers nothing.
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer " + "x" * 43}).status_code == 401
    agent.process.send_signal(signal.SIGTERM)  # nothing runs: it leaves at once
    assert agent.process.wait(30) == 0
    assert registered(etcd, "host-b") is None


def test_a_member_of_a_placement_starts_only_once_it_is_committed(
    agents: Any, etcd: Etcd, etcd_server: EmbeddedEtcd
) -> None:
    """Assignments naming a placement wait for `<ns>/placements/<id>`; one deleted before
    the commit never runs. The agent handles what it sees in order, so a plain member
    assigned after one that waits has been handled after it."""
    agents("--id", "host-p", "--slots", "4")
    wait_until(lambda: registered(etcd, "host-p"), 30, "the agent to register")

    def worker(job: str) -> list[str]:
        return ["--job", job, "--world-size", "1", "--etcd", etcd_server.endpoint,
                "--namespace", etcd.namespace]  # fmt: skip

    def exited(name: str) -> dict[str, Any] | None:
        kv = etcd.get(etcd.key("reports", "host-p", name))
        report = json.loads(kv.value) if kv else None
        return report if report and report["state"] == "exited" else None

    def reported(name: str) -> bool:
        return etcd.get(etcd.key("reports", "host-p", name)) is not None

    first, second, third = (f"{job}-0123-a1-0123456789abcdef" for job in ("wa", "wb", "wc"))
    assign(etcd, "host-p", "wa-0123-a1-m0", worker("wa"), placement=first)
    assign(etcd, "host-p", "wb-0123-a1-m0", worker("wb"), placement=second)
    assign(etcd, "host-p", "plain-0123-a1-m0", worker("plain"))
    wait_until(lambda: exited("plain-0123-a1-m0"), 60, "the plain member to run")
    assert not reported("wa-0123-a1-m0") and not reported("wb-0123-a1-m0")  # waiting

    etcd.put(etcd.key("placements", first), "{}")  # committed: it runs
    state = wait_until(lambda: exited("wa-0123-a1-m0"), 60, "the committed member to run")
    assert state["exit_code"] == 0
    etcd.delete(etcd.key("assignments", "host-p", "wb-0123-a1-m0"))  # withdrawn, then
    etcd.put(etcd.key("placements", second), "{}")  # committed: it must not run
    assign(etcd, "host-p", "wc-0123-a1-m0", worker("wc"), placement=third)
    etcd.put(etcd.key("placements", third), "{}")  # seen after the second's commit
    wait_until(lambda: exited("wc-0123-a1-m0"), 60, "the last committed member to run")
    assert not reported("wb-0123-a1-m0")


def test_sigterm_drains_a_running_member_and_deregisters_first(
    agents: Any, etcd: Etcd, etcd_server: EmbeddedEtcd
) -> None:
    agent = agents("--id", "host-c", "--slots", "1", "--drain-seconds", "1")
    wait_until(lambda: registered(etcd, "host-c"), 30, "the agent to register")
    worker = ["--job", "drained", "--world-size", "1", "--etcd", etcd_server.endpoint,
              "--namespace", etcd.namespace, "--param", "seconds=60"]  # fmt: skip
    assign(etcd, "host-c", "drained-0123-a1-m0", worker)
    member = etcd.key("reports", "host-c", "drained-0123-a1-m0")
    wait_until(lambda: etcd.get(member), 30, "the member to run")
    agent.process.send_signal(signal.SIGTERM)
    wait_until(lambda: registered(etcd, "host-c") is None, 10, "the agent to deregister")
    assert agent.process.wait(30) == 0  # the member got SIGTERM after 1 s, and left
    assert etcd.get(member) is None  # its report went with the agent's lease


@pytest.mark.slow  # ~10 s: a cut past the lease, then a member
def test_an_agent_cut_off_past_its_lease_stops_its_members_and_registers_again(
    etcd: Etcd, etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    """Its lease, assignments and reports are gone (the service counts its members lost),
    so it stops them, then registers anew once etcd answers, and takes new work."""
    proxy = CuttableProxy(etcd_server.endpoint)
    agent = AgentProc(proxy.endpoint, etcd.namespace, tmp_path / "cut", "--id", "host-d")
    try:
        first = wait_until(lambda: etcd.get(etcd.key("agents", "host-d")), 30, "registration")
        worker = ["--job", "longrun", "--world-size", "1", "--etcd", etcd_server.endpoint,
                  "--namespace", etcd.namespace, "--param", "seconds=120"]  # fmt: skip
        assign(etcd, "host-d", "longrun-0123-a1-m0", worker)
        report = etcd.key("reports", "host-d", "longrun-0123-a1-m0")
        pid = wait_until(lambda: (kv := etcd.get(report)) and json.loads(kv.value)["pid"], 30,
                         "the member to run")  # fmt: skip
        proxy.cut()
        wait_until(lambda: etcd.get(etcd.key("agents", "host-d")) is None, 10, "the lease to end")
        proxy.restore()
        again = wait_until(
            lambda: (
                (kv := etcd.get(etcd.key("agents", "host-d"))) and kv.lease != first.lease and kv
            ),
            30,
            "the agent to register again",
        )
        assert json.loads(again.value)["pid"] == agent.process.pid
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), 15, "its old member to be stopped")
        worker = ["--job", "after", "--world-size", "1", "--etcd", etcd_server.endpoint,
                  "--namespace", etcd.namespace]  # fmt: skip
        assign(etcd, "host-d", "after-0123-a1-m0", worker)
        after = etcd.key("reports", "host-d", "after-0123-a1-m0")
        state = wait_until(
            lambda: (kv := etcd.get(after)) and json.loads(kv.value)["state"] == "exited"
            and json.loads(kv.value), 60, "the new member to run and end",
        )  # fmt: skip
        assert state["exit_code"] == 0 and agent.process.poll() is None
    finally:
        agent.stop()
        proxy.close()
