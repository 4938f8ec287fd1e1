"""`coordinator agent` as a process for the tests, an agent's registration as the service
reads it, and a watch on what agents report of their members."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from coordinator.etcd.client import Etcd
from coordinator.etcd.session import Session
from coordinator.etcd.watch import WatchEvent
from coordinator.service.placement.protocol import REGISTRATION, signed_assignment
from tests.support.cgroups import remove_member_cgroups
from tests.support.signing import key_files, session_signer


class AgentProc:
    """`coordinator agent` with a 2 s TTL: a killed agent's registration ends soon."""

    def __init__(self, endpoint: str, namespace: str, data: Path, *extra: str) -> None:
        args = [
            sys.executable, "-m", "coordinator", "agent", "--etcd", endpoint,
            "--namespace", namespace, "--data-dir", str(data), "--ttl", "2", *extra,
        ]  # fmt: skip
        if "--service-key" not in extra:  # the session's key, which `ServiceProc` signs with
            args += ["--service-key", str(key_files()[1])]
        self.data = data
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate(timeout=30)
        remove_member_cgroups(self.data / "logs")  # its members died with it, unseen


def registered(etcd: Etcd, agent_id: str) -> dict[str, Any] | None:
    """The agent's registration as the service reads it; None while it has none."""
    kv = etcd.get(etcd.key("agents", agent_id))
    return json.loads(kv.value) if kv else None


def as_the_service(etcd: Etcd, agent_id: str, assignment: dict[str, Any]) -> bytes:
    """`assignment` signed as the service signs it, for the agent's live registration."""
    kv = etcd.get(etcd.key("agents", agent_id))
    assert kv is not None, f"agent {agent_id} is not registered"
    body = {REGISTRATION: kv.create_revision, **assignment}
    return signed_assignment(session_signer(), agent_id, body)


def register(etcd: Etcd, agent_id: str, slots: int, session: Session) -> None:
    """A stand-in agent's registration on `session`'s lease: room to place on, no process."""
    record = {"slots": slots, "labels": {}, "address": "127.0.0.1:9", "pid": 0, "token": "t" * 43}
    etcd.put(etcd.key("agents", agent_id), json.dumps(record), session.lease_id)


class SlotWatch:
    """The most members any agent ran at once, from the agents' own reports."""

    def __init__(self, etcd: Etcd) -> None:
        self.states: dict[str, tuple[str, str]] = {}  # member -> (agent, state)
        self.most: dict[str, int] = {}
        self.started: set[str] = set()
        self.exits: dict[str, float] = {}  # member -> when its agent saw it end
        self.pids: dict[str, set[int]] = {}  # agent -> the pids of the members it started
        self._lock = threading.Lock()
        self.prefix = etcd.key("reports") + "/"
        self._watch = etcd.watch(self.prefix, self._on, start_revision=0, prefix=True)

    def _on(self, events: list[WatchEvent]) -> None:
        with self._lock:
            for event in events:
                name = event.key.rpartition("/")[2]  # reports/<agent>/<member>
                if event.kind == "delete":
                    self.states.pop(name, None)
                    continue
                report = json.loads(event.value)
                self.states[name] = (report["agent"], report["state"])
                if report["state"] == "running":
                    self.started.add(name)
                    self.pids.setdefault(report["agent"], set()).add(report["pid"])
                else:
                    self.exits.setdefault(name, report["at"])
            for agent in {agent for agent, _ in self.states.values()}:
                running = sum(1 for a, s in self.states.values() if a == agent and s == "running")
                self.most[agent] = max(self.most.get(agent, 0), running)

    def close(self) -> None:
        self._watch.cancel()
