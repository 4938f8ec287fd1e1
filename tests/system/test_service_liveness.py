"""Liveness a tenant cannot pin, and a service that never hangs (issue 28, items 3 and 4):
a wedged etcd, SIGTERM, a stranger keeping the leader's lease alive, a NOSPACE alarm
nobody needed, and an agent whose output server drips."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from pyetcd import etcdrpc

from coordinator.agent.output import IDLE_SECONDS, MAX_CONNECTIONS
from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.session import Session
from coordinator.etcd.watchdog import STALL_ALLOWANCE
from coordinator.service.rest.readiness import Readiness
from tests.support.agents import SlotWatch, registered
from tests.support.service import ServiceProc, kill_members, wait_state
from tests.support.wait import wait_until


@contextlib.contextmanager
def own_etcd_service(data: Path, *extra: str) -> Iterator[tuple[ServiceProc, psutil.Process]]:
    """A service on an etcd of its own (in `data`), which a test may stop and resume; the
    service, its members and its etcd are killed at the end, also on failure."""
    data.mkdir()
    service = ServiceProc("", "/liveness", data, *extra)
    etcd: psutil.Process | None = None
    try:
        service.ready()
        record = json.loads((data / "etcd.json").read_text())
        etcd = psutil.Process(record["pid"])
        yield service, etcd
    finally:
        if etcd is not None:
            with contextlib.suppress(psutil.Error):
                etcd.resume()
        service.kill()
        service.stop()
        kill_members(data)
        if etcd is not None:
            with contextlib.suppress(psutil.Error):
                etcd.kill()
                etcd.wait(10)


def timed_get(url: str, timeout: float = 5.0) -> tuple[int, float]:
    began = time.monotonic()
    response = httpx.get(url, timeout=timeout)
    return response.status_code, time.monotonic() - began


def test_a_stopped_etcd_makes_readyz_answer_503_within_a_second(tmp_path: Path) -> None:
    with own_etcd_service(tmp_path / "s") as (service, etcd):
        assert timed_get(f"{service.url}/readyz")[0] == 200
        etcd.suspend()  # SIGSTOP: every call to it hangs until its deadline
        stopped_at = time.monotonic()
        answers = []
        while time.monotonic() - stopped_at < 8:
            status, took = timed_get(f"{service.url}/readyz")
            health, _ = timed_get(f"{service.url}/healthz")
            answers.append(
                (round(time.monotonic() - stopped_at, 1), status, round(took, 2), health)
            )
        print(answers)
        assert all(took < 1.0 for _, _, took, _ in answers), answers
        assert all(status == 503 for at, status, _, _ in answers if at > 1.0), answers
        # An outage with working deadlines is not a wedge: restarting would not help.
        assert all(health == 200 for *_, health in answers), answers


def test_sigterm_ends_the_service_within_its_grace_while_etcd_is_stopped(tmp_path: Path) -> None:
    with own_etcd_service(tmp_path / "s") as (service, etcd):
        spec = {"id": "busy", "kind": "noop", "workers": 1, "params": {"seconds": "60"}}
        assert service.http.post("/v1/jobs", json=spec).status_code == 201
        wait_until(lambda: service.job("busy")["state"] == "RUNNING", 60, "the job to run")
        etcd.suspend()
        time.sleep(0.5)  # (not a synchronisation: lets the reconciler enter a hanging call)
        began = time.monotonic()
        service.process.send_signal(signal.SIGTERM)
        service.process.wait(15)
        took = time.monotonic() - began
        print(f"SIGTERM to exit with etcd stopped: {took:.2f}s (grace 3s)")
        assert took < 3.0, took


def test_a_wedged_etcd_call_fails_healthz_and_readyz_answers_at_once(etcd: Etcd) -> None:
    """A call that ignores its deadline (as gRPC's did on a starved host) is a real
    thread stuck inside the client's call path; the probes see it without joining it."""
    readiness = Readiness(etcd, etcd.key("api", "leader"))
    release = threading.Event()
    wedged = threading.Thread(
        target=lambda: etcd._call(lambda options: release.wait(60), window=0.5), daemon=True
    )
    try:
        assert readiness.alive() is None and readiness.ready() is None
        wedged.start()
        began = time.monotonic()
        reason = wait_until(readiness.alive, 0.5 + STALL_ALLOWANCE + 1, "the watchdog to bite")
        took = time.monotonic() - began
        assert 0.5 + STALL_ALLOWANCE - 0.1 < took < 0.5 + STALL_ALLOWANCE + 1, took
        assert "past its deadline" in reason
        asked = time.monotonic()
        assert readiness.ready() == reason
        assert time.monotonic() - asked < 0.1
    finally:
        release.set()
        wedged.join(5)
        readiness.close()
    assert readiness.alive() is None  # the call ended: alive again


LEADER_TTL = 5  # the service's leadership lease (`ServiceOptions.leader_ttl`)


def leader_pid(etcd: Etcd) -> int | None:
    """The pid in the replica name of the leader key (`<host>-<pid>-<random>`)."""
    kv = etcd.get(etcd.key("api", "leader"))
    return None if kv is None else int(kv.value.decode().rsplit("-", 2)[1])


def test_a_leader_whose_lease_a_stranger_keeps_alive_is_replaced_within_ttl_and_2s(
    serve: Callable[..., ServiceProc], etcd: Etcd
) -> None:
    first = serve()
    wait_until(lambda: leader_pid(etcd) == first.process.pid, 20, "the first to lead")
    second = serve()
    leader = etcd.get(etcd.key("api", "leader"))
    assert leader is not None
    stop = threading.Event()
    kept: list[int] = []  # what each of the stranger's keep-alives said was left

    def stranger() -> None:  # any etcd user may keep any lease alive
        while not stop.wait(0.5):
            with contextlib.suppress(EtcdError):
                kept.append(etcd.keepalive(leader.lease))

    keeper = threading.Thread(target=stranger, daemon=True)
    keeper.start()
    try:
        wait_until(lambda: kept, 5, "the stranger's first keep-alive")
        first.kill()  # its lease lives on: the stranger renews it
        killed_at = time.monotonic()
        wait_until(
            lambda: leader_pid(etcd) == second.process.pid, LEADER_TTL + 5, "the second to lead"
        )
        took = time.monotonic() - killed_at
    finally:
        stop.set()
        keeper.join(5)
    print(f"leader replaced {took:.2f}s after it died, its lease kept alive (TTL {LEADER_TTL}s)")
    assert kept[-1] > 0, "the stranger did not keep the dead leader's lease alive"
    assert took <= LEADER_TTL + 2, took
    assert "deposed leader" in second.output()


def test_a_nospace_alarm_the_database_does_not_justify_is_disarmed_and_logged(
    serve: Callable[..., ServiceProc], etcd: Etcd
) -> None:
    service = serve()
    nospace = etcdrpc.AlarmType.Value("NOSPACE")
    status = etcd.maintenance_api("Status", etcdrpc.StatusRequest())
    raised = etcdrpc.AlarmRequest(
        action=etcdrpc.AlarmRequest.ACTIVATE, memberID=status.header.member_id, alarm=nospace
    )
    etcd.maintenance_api("Alarm", raised)  # what a job's own etcd user could do
    raised_at = time.monotonic()
    get = etcdrpc.AlarmRequest(action=etcdrpc.AlarmRequest.GET)
    try:
        wait_until(
            lambda: not etcd.maintenance_api("Alarm", get).alarms, 10, "the alarm to be disarmed"
        )
    finally:  # never leave the session's etcd refusing writes
        for alarm in etcd.maintenance_api("Alarm", get).alarms:
            etcd.maintenance_api(
                "Alarm",
                etcdrpc.AlarmRequest(
                    action=etcdrpc.AlarmRequest.DEACTIVATE,
                    memberID=alarm.memberID,
                    alarm=alarm.alarm,
                ),
            )
    print(f"NOSPACE alarm disarmed {time.monotonic() - raised_at:.2f}s after it was raised")
    wait_until(lambda: "disarmed a NOSPACE alarm" in service.output(), 5, "the log line")
    spec = {"id": "after-alarm", "kind": "noop", "workers": 1}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201


class DripServer:
    """An agent's output server gone hostile: it answers every request with headers
    promising a long body, then sends one byte every `every` seconds."""

    def __init__(self, every: float = 2.0) -> None:
        self.every = every
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            while not self._stop.wait(self.every):
                conn.sendall(b"x")

    def close(self) -> None:
        self._stop.set()
        self.listener.close()


@pytest.mark.slow  # 22-42 s: an agent, a service and three jobs one after another
def test_an_agent_whose_output_server_drips_delays_no_other_job_by_more_than_a_second(
    serve: Callable[..., ServiceProc], agents: Any, etcd: Etcd, slots: SlotWatch
) -> None:
    drip = DripServer()
    session = Session(etcd, ttl=5)
    try:
        record = {"slots": 1, "labels": {"role": "drip"}, "address": drip.address, "pid": 0,
                  "token": "t" * 43}  # fmt: skip
        etcd.put(etcd.key("agents", "dripping"), json.dumps(record), session.lease_id)
        agents("--id", "honest", "--slots", "2", "--label", "role=honest")
        wait_until(lambda: registered(etcd, "honest"), 30, "the honest agent to register")
        service = serve("--default-launcher", "agents")
        spec = {"id": "stuck", "kind": "noop", "workers": 1, "agent_selector": {"role": "drip"}}
        assert service.http.post("/v1/jobs", json=spec).status_code == 201
        wait_until(lambda: drip.connections >= 1, 30, "the service to read the dripping output")
        delays = []
        for n in range(3):
            job_id = f"quick-{n}"
            spec = {"id": job_id, "kind": "noop", "workers": 1,
                    "agent_selector": {"role": "honest"}}  # fmt: skip
            assert service.http.post("/v1/jobs", json=spec).status_code == 201
            done = wait_state(service, job_id, {"SUCCEEDED", "FAILED"}, timeout=60)
            assert done["state"] == "SUCCEEDED", done["conditions"]
            ended = next(at for name, at in slots.exits.items() if name.startswith(job_id))
            succeeded = next(c["at"] for c in done["conditions"] if c["state"] == "SUCCEEDED")
            delays.append(round(succeeded - ended, 3))
        print(f"member exit to SUCCEEDED beside a dripping agent: {delays} s")
        assert max(delays) <= 1.0, delays
        assert service.job("stuck")["state"] in ("STARTING", "RUNNING")
    finally:
        session.close()
        drip.close()


def test_the_agents_output_server_caps_its_connections_and_closes_idle_ones(
    agents: Any, etcd: Etcd
) -> None:
    agents("--id", "capped", "--slots", "1")
    address = wait_until(lambda: registered(etcd, "capped"), 30, "the agent to register")["address"]
    host, _, port = address.rpartition(":")
    idle = [socket.create_connection((host, int(port)), timeout=15) for _ in range(MAX_CONNECTIONS)]
    try:
        opened = time.monotonic()
        # One more finds no room: closed unanswered at once, not queued behind the idle.
        with socket.create_connection((host, int(port)), timeout=5) as extra:
            extra.sendall(b"GET /members/x/output HTTP/1.0\r\n\r\n")
            assert extra.recv(100) == b""
        # The idle ones are closed by the server after IDLE_SECONDS of silence.
        for conn in idle:
            assert conn.recv(100) == b""
        closed_after = time.monotonic() - opened
        print(f"{MAX_CONNECTIONS} idle connections closed after {closed_after:.1f}s")
        assert IDLE_SECONDS - 1 < closed_after < IDLE_SECONDS + 3, closed_after
        # Room again: a request is answered (401: no token).
        with socket.create_connection((host, int(port)), timeout=5) as after:
            after.sendall(b"GET /members/x/output HTTP/1.0\r\n\r\n")
            assert after.recv(100).startswith(b"HTTP/1.0 401")
    finally:
        for conn in idle:
            conn.close()
