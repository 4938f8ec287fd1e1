"""An agent: one host's long-running process that runs the members etcd assigns to it.

Keys, under `<ns>/`:

- `agents/<id>`: `{slots, labels, address, version, pid}`, bound to the agent's
  lease. A second agent with the same id is refused at registration (the key is
  created only if absent), so two hosts never share an identity. An agent that
  dies loses the key within its TTL, and with it every member report below.
- `assignments/<id>/<member>`: what the service's `agents` launcher wants run
  (`{run_id, attempt, index, worker_args}`); `<member>` is
  `<run_id>-a<attempt>-m<index>`, so an assignment names its member uniquely.
- `members/<member>`: `{agent, pid, state, exit_code}` as this agent sees the
  member (`running`, then `exited`), bound to the agent's lease.

The agent starts each assigned member once, with the local launcher (its own
session, output to a file), and serves that output over HTTP at its address
(`GET /members/<member>/output?offset=N`), so the service's logs endpoint
reaches it on whichever host it ran. On SIGTERM it drains: it deregisters (no
new assignments can name it), takes nothing new, and waits for its members to
end, sending them SIGTERM after `drain_seconds`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from coordinator.etcd.client import Etcd, WatchEvent
from coordinator.etcd.session import Session
from coordinator.service.launchers.local import LocalLauncher
from coordinator.service.model import Member

REPORT_SECONDS = 0.25  # how often running members are checked for their end


class AgentTaken(RuntimeError):
    """Another live agent holds this id."""


@dataclass
class AgentOptions:
    agent_id: str
    slots: int
    data_dir: Path
    labels: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"  # where the service reaches this agent's output
    port: int = 0
    ttl: int = 10
    drain_seconds: float = 30.0


class Agent:
    def __init__(self, etcd: Etcd, options: AgentOptions) -> None:
        self.etcd, self.options = etcd, options
        self.launcher = LocalLauncher(options.data_dir / "logs")
        self.members: dict[str, Member] = {}  # member name -> the running member
        self.assignments = etcd.key("assignments", options.agent_id) + "/"
        self._lock = threading.Lock()
        self._draining = threading.Event()
        self._http = ThreadingHTTPServer((options.host, options.port), self._handler())
        self.address = f"{options.host}:{self._http.server_address[1]}"
        self.session = Session(etcd, options.ttl)
        record = {
            "slots": options.slots,
            "labels": options.labels,
            "address": self.address,
            "version": version("etcd-coordinator"),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        created, current, _ = etcd.create(
            etcd.key("agents", options.agent_id), json.dumps(record), self.session.lease_id
        )
        if not created:
            self.session.close()
            self._http.server_close()
            holder = json.loads(current.value)
            raise AgentTaken(
                f"agent id {options.agent_id!r} is registered by another live agent "
                f"(host {holder.get('host')}, pid {holder.get('pid')}); choose another --id"
            )
        threading.Thread(target=self._http.serve_forever, daemon=True, name="agent-http").start()
        kvs, revision = etcd.get_prefix(self.assignments)
        for kv in kvs:
            self._assigned(kv.key, kv.value)
        self._watch = etcd.watch(
            self.assignments, self._on_assignments, start_revision=revision + 1, prefix=True
        )

    # -- assignments --------------------------------------------------------------

    def _on_assignments(self, events: list[WatchEvent]) -> None:
        for event in events:
            if event.kind == "put":
                self._assigned(event.key, event.value)

    def _assigned(self, key: str, value: bytes) -> None:
        name = key[len(self.assignments) :]
        with self._lock:
            if name in self.members or self._draining.is_set():
                return
            if len(self.running()) >= self.options.slots:
                return  # the launcher never over-fills an agent; a stray key is ignored
            assignment = json.loads(value)
            member = self.launcher.start(
                assignment["run_id"], assignment["attempt"], assignment["index"],
                assignment["worker_args"],
            )  # fmt: skip
            self.members[name] = member
        self._report(name, member, None)

    def running(self) -> list[str]:
        return [n for n, m in self.members.items() if m.exit_code is None]

    def _report(self, name: str, member: Member, code: int | None) -> None:
        state = {
            "agent": self.options.agent_id,
            "pid": member.pid,
            "state": "running" if code is None else "exited",
            "exit_code": code,
        }
        self.etcd.put(self.etcd.key("members", name), json.dumps(state), self.session.lease_id)

    def check_members(self) -> None:
        """Report every member that ended since the last check."""
        with self._lock:
            ended = []
            for name, member in self.members.items():
                if member.exit_code is None:
                    code = self.launcher.exit_code(member)
                    if code is not None:
                        self.members[name] = member.model_copy(update={"exit_code": code})
                        ended.append((name, self.members[name], code))
        for name, member, code in ended:
            self._report(name, member, code)

    # -- running and draining ---------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Until `stop` (SIGTERM): report members as they end; then drain."""
        while not stop.wait(REPORT_SECONDS) and not self.session.lost.is_set():
            self.check_members()
        self.drain()

    def drain(self) -> None:
        self._draining.set()
        self._watch.cancel()
        self.etcd.delete(self.etcd.key("agents", self.options.agent_id))
        deadline = time.monotonic() + self.options.drain_seconds
        terminated = False
        while True:
            self.check_members()
            with self._lock:
                left = [self.members[n] for n in self.running()]
            if not left:
                break
            if time.monotonic() > deadline and not terminated:
                for member in left:
                    self.launcher.terminate(member)
                terminated = True
                deadline = time.monotonic() + self.options.drain_seconds
            elif time.monotonic() > deadline:
                for member in left:
                    self.launcher.kill(member)
            time.sleep(REPORT_SECONDS)  # a few processes, checked four times a second
        self.close()

    def close(self) -> None:
        self._watch.cancel()
        self._http.shutdown()
        self._http.server_close()
        self.session.close(revoke=True)

    # -- output over HTTP ---------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        agent = self

        class Output(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # the http.server interface
                url = urlparse(self.path)
                parts = url.path.strip("/").split("/")
                with agent._lock:
                    member = (
                        agent.members.get(parts[1])
                        if len(parts) == 3 and parts[0] == "members" and parts[2] == "output"
                        else None
                    )
                if member is None:
                    self.send_error(404, "no such member on this agent")
                    return
                offset = int(parse_qs(url.query).get("offset", ["0"])[0] or 0)
                body = agent.launcher.output(member, max(0, offset))
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # members' output is the log that matters

        return Output
