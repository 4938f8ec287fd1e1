"""An agent: one host's long-running process that runs the members etcd assigns to it.

It registers under its lease (`records`: a second agent with a live id is
refused, so two hosts never share an identity), watches its assignments, and starts
each assigned member once with the local launcher (its own session, output to a
file), pointed at etcd as this agent reaches it. It reports each member's state,
signals a member whose assignment asks for `stop`, and serves the members' output
over HTTP (`output`). A member of a placement written ahead of its commit waits
for the commit (`commits`).

It trusts nothing it reads: an assignment must carry the service's signature, for this
agent and this registration of it, checked with the service's public key
(`placement.protocol.verified_assignment`); one that does not, or does not pass `Assignment` (the
options the service writes and no others, paths inside its data dir, its own
namespace) is reported `refused` and never runs. A member gets its job's etcd user
from the assignment, in a file only it may read.

Members die with the agent (the kernel kills them when it dies, however it
dies): its lease, and so its assignments, go with it too, and the service's
restart policy decides what happens to the job. On SIGTERM it drains instead: it
deregisters (no new assignments can name it), takes nothing new, and waits for
its members to end, sending them SIGTERM after `drain_seconds`.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError

from coordinator.agent.commits import PlacementCommits
from coordinator.agent.output import output_server
from coordinator.agent.records import (
    member_report,
    refusal_reason,
    refusal_report,
    register,
    registration_record,
)
from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError, EtcdRefused
from coordinator.etcd.session import Session
from coordinator.etcd.txn import Delete, Put
from coordinator.etcd.watch import WatchEvent
from coordinator.jobs.environment import WORKING_DIR_ROOT_ENV
from coordinator.keys import Keys, member_name
from coordinator.launch.pids import DEFAULT_PIDS_LIMIT
from coordinator.service.launchers import VANISHED
from coordinator.service.launchers.local import LocalLauncher
from coordinator.service.model import Member
from coordinator.service.placement.protocol import Assignment, verified_assignment

log = logging.getLogger(__name__)

REPORT_SECONDS = 0.25  # how often running members are checked for their end
# What the main thread is told (`Agent._take`).
ASSIGNED, WITHDRAWN, COMMITTED, UNCOMMITTED = "assigned", "withdrawn", "committed", "uncommitted"


class _Stopped(Exception):
    """Asked to stop while waiting to register again."""


@dataclass
class AgentOptions:
    agent_id: str
    slots: int
    data_dir: Path
    service_key: Ed25519PublicKey  # what the service's assignments must be signed with
    labels: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"  # where the output server listens
    port: int = 0
    advertise: str | None = None  # where the service reaches it [host, or the route to etcd]
    ttl: int = 10
    drain_seconds: float = 30.0
    gpus: tuple[int, ...] = ()  # the GPU ids it offers; members get the ones assigned
    member_pids_limit: int = DEFAULT_PIDS_LIMIT  # processes and threads of each member
    run_as: range | None = None  # the uids its members' programs run under (`--run-as-uids`)


@dataclass
class Running:
    """A member this agent started: the launcher's handle, and the stop asked for."""

    member: Member
    stop: str | None = None


class Agent:
    def __init__(self, etcd: Etcd, options: AgentOptions) -> None:
        self.etcd, self.options = etcd, options
        options.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # A command job's folder: in the data dir, or a root the agent's operator set.
        self.working_dir_roots = [
            str(options.data_dir.resolve()),
            *(r for r in os.environ.get(WORKING_DIR_ROOT_ENV, "").split(os.pathsep) if r),
        ]
        self.launcher = LocalLauncher(
            options.data_dir / "logs",
            die_with_parent=True,
            workdir=options.data_dir,
            extra_env={WORKING_DIR_ROOT_ENV: os.pathsep.join(self.working_dir_roots)},
            pids_limit=options.member_pids_limit,
            run_as=options.run_as,
        )
        self.members: dict[str, Running] = {}  # member name -> what runs (or ran)
        self.keys = Keys(etcd.namespace)
        # What the watches saw, for the main thread: (what, name, value), `what` one of
        # ASSIGNED, WITHDRAWN (an assignment deleted), COMMITTED, UNCOMMITTED (a
        # placement's commit written, deleted).
        self._inbox: queue.SimpleQueue[tuple[str, str, bytes]] = queue.SimpleQueue()
        self.commits = PlacementCommits(etcd, self.keys, self._on_placements)
        self._lock = threading.Lock()
        self._draining = False
        self.token = secrets.token_urlsafe(32)  # what the output server asks of a request
        self._http, self.address = output_server(
            options.host, options.port, options.advertise, etcd.endpoints,
            self.token, self._member, self.launcher.output,
        )  # fmt: skip
        self._record = registration_record(
            options.slots, options.labels, self.address, self.token, options.gpus
        )
        try:
            self._register()
        except BaseException:
            self._http.server_close()
            raise
        threading.Thread(target=self._http.serve_forever, daemon=True, name="agent-http").start()

    def _register(self) -> None:
        """A new lease, the registration under it, and the watch of its assignments."""
        self.session = Session(self.etcd, self.options.ttl)
        key = self.keys.agent(self.options.agent_id)
        revision = register(self.etcd, self.session, key, self._record, self.options.agent_id)
        self.registration = revision  # what the service's assignments to it must name
        # Assignments are bound to this agent's lease, new with this registration: there
        # are none before it.
        self._watch = self.etcd.watch(
            self.keys.assignments(self.options.agent_id), self._on_assignments,
            start_revision=revision, prefix=True,
        )  # fmt: skip

    def _rejoin(self, stop: threading.Event) -> None:
        """After the lease was lost (etcd out of reach for a TTL): its assignments went
        with it and the service counts its members lost, so they are stopped; then the
        agent registers anew, as soon as etcd answers, and takes new work."""
        print(
            f"agent {self.options.agent_id}: lost its lease ({self.session.lost_reason}); "
            "stopping its members and registering again",
            flush=True,
        )
        self._watch.cancel()
        self.commits.forget()
        self.session.close(revoke=False)
        self._stop_members(grace=5.0)
        with self._lock:
            self.members.clear()
        while not self._inbox.empty():  # assignments of the old lease: gone with it
            self._inbox.get_nowait()
        delay = 0.5
        while not stop.is_set():
            try:
                self._register()
                print(f"agent {self.options.agent_id}: registered again", flush=True)
                return
            except EtcdError as exc:
                log.warning("agent %s: cannot register yet: %s", self.options.agent_id, exc)
                stop.wait(delay)  # etcd is still out of reach: try again, backing off
                delay = min(delay * 2, 5.0)
        raise _Stopped

    def _stop_members(self, grace: float) -> None:
        """SIGTERM to every running member, SIGKILL to those left after `grace` seconds."""
        for name in self.running():
            self.launcher.terminate(self.members[name].member)
        deadline = time.monotonic() + grace
        while self._still_running() and time.monotonic() < deadline:
            time.sleep(REPORT_SECONDS)  # polling the members' exits, as check_members does
        for member in self._still_running():
            self.launcher.kill(member)

    def _still_running(self) -> list[Member]:
        with self._lock:
            members = [r.member for r in self.members.values() if r.member.exit_code is None]
        return [m for m in members if self.launcher.exit_code(m) is None]

    # -- assignments --------------------------------------------------------------

    def _on_assignments(self, events: list[WatchEvent]) -> None:
        """Queued for the main thread, which alone starts members: they die with the
        thread that started them (see `LocalLauncher`), and it lives as long as we do."""
        for event in events:
            what = ASSIGNED if event.kind == "put" else WITHDRAWN
            self._inbox.put((what, self.keys.assigned(event.key)[1], event.value))

    def _on_placements(self, events: list[WatchEvent]) -> None:
        for event in events:
            what = COMMITTED if event.kind == "put" else UNCOMMITTED
            self._inbox.put((what, self.keys.placement_id(event.key), b""))

    def _take(self, what: str, name: str, value: bytes) -> None:
        """One thing the watches saw, on the main thread."""
        if what == ASSIGNED:
            self._handle(name, value)
        elif what == WITHDRAWN:  # a waiting member deleted before its commit: never runs
            self.commits.drop(name)
        elif what == COMMITTED:
            self.commits.commit_seen(name)
            self._start_committed()
        else:
            self.commits.commit_gone(name)

    def _start_committed(self) -> None:
        """Handle the waiting members whose placement is now committed, as their
        assignments now are (a stop written meanwhile, or deleted: never run). Asked
        again each round, so one that failed for etcd is tried again."""
        for member in self.commits.ready():
            kv = self.etcd.get(self.keys.assignment(self.options.agent_id, member))
            if kv is None:
                self.commits.drop(member)
            else:
                self._handle(member, kv.value)

    def _handle(self, name: str, value: bytes) -> None:
        with self._lock:
            running = self.members.get(name)
        try:
            verified = verified_assignment(
                self.options.service_key, self.options.agent_id, self.registration, value
            )
            assignment = Assignment.model_validate_json(
                verified,
                context={
                    "namespace": self.etcd.namespace,
                    "data_dir": self.options.data_dir,
                    "working_dir_roots": self.working_dir_roots,
                    "gpus": self.options.gpus,
                },
            )
            if name != member_name(assignment.run_id, assignment.attempt, assignment.index):
                raise ValueError(f"the key names {name!r}, not the member the value describes")
        except (ValidationError, ValueError) as exc:
            reason = refusal_reason(name, exc)
            log.warning("%s", reason)
            print(f"agent: {reason}", flush=True)
            if running is None:
                self._refused(name, reason)
            return
        stop = assignment.stop
        if running is not None:
            if stop and running.stop != "SIGKILL" and running.member.exit_code is None:
                running.stop = stop
                signal = self.launcher.kill if stop == "SIGKILL" else self.launcher.terminate
                signal(running.member)
            return
        if stop or self._draining or len(self.running()) >= self.options.slots:
            # Stopped before it started, or placed on an agent that is leaving (or, never
            # by the service, beyond the slots): it ends without running.
            self.commits.drop(name)
            self._ended(name, Member(index=assignment.index), VANISHED)
            return
        if assignment.placement is not None:
            try:
                committed = self.commits.is_committed(assignment.placement)
            except EtcdRefused as exc:
                if exc.cause != "permission-denied":
                    raise
                reason = (
                    f"assignment {name} refused: this agent's etcd user may not read "
                    f"{self.keys.placements} (renew it: coordinator credentials agent)"
                )
                print(f"agent: {reason}", flush=True)
                self._refused(name, reason)
                return
            if not committed:
                self.commits.wait(name, assignment.placement)  # until its commit, or deletion
                return
            self.commits.drop(name)
        credentials = assignment.credentials
        command = assignment.worker_command(",".join(self.etcd.urls))
        member = self.launcher.start_member(
            assignment.run_id,
            assignment.attempt,
            assignment.index,
            command,
            credentials.credentials() if credentials is not None else None,
        )
        with self._lock:
            self.members[name] = Running(member)
        self._report(name, member, None)

    def _member(self, name: str) -> Member | None:
        """The member of that name this agent started (running or ended), if any."""
        with self._lock:
            running = self.members.get(name)
        return running.member if running is not None else None

    def running(self) -> list[str]:
        with self._lock:
            return [n for n, r in self.members.items() if r.member.exit_code is None]

    def _report(self, name: str, member: Member, code: int | None) -> None:
        key = self.keys.report(self.options.agent_id, name)
        self.etcd.put(
            key, member_report(self.options.agent_id, member, code), self.session.lease_id
        )

    def _ended(self, name: str, member: Member, code: int) -> None:
        """Report the end and free the slot, in one transaction: the service sees the
        member assigned, or its report, never neither while this agent lives."""
        self._settle(name, member_report(self.options.agent_id, member, code))

    def _refused(self, name: str, reason: str) -> None:
        """Report an assignment that will never run, and drop it."""
        self._settle(name, refusal_report(self.options.agent_id, reason))

    def _settle(self, name: str, report: str) -> None:
        agent_id = self.options.agent_id
        key = self.keys.report(agent_id, name)
        assigned = self.keys.assignment(agent_id, name)
        self.etcd.transaction([Put(key, report, self.session.lease_id), Delete(assigned)])

    def check_members(self) -> None:
        """Report every member that ended since the last check."""
        ended = []
        with self._lock:
            for name, running in self.members.items():
                member = running.member
                if member.exit_code is None:
                    code = self.launcher.exit_code(member)
                    if code is not None:
                        running.member = member.model_copy(update={"exit_code": code})
                        ended.append((name, running.member, code))
        for name, member, code in ended:
            self._ended(name, member, code)

    # -- running and draining ---------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Until `stop` (SIGTERM): start what is assigned, report members as they end;
        then drain."""
        while not stop.is_set():
            if self.session.lost.is_set():
                try:
                    self._rejoin(stop)
                except _Stopped:
                    break
                continue
            try:
                self._work(REPORT_SECONDS)
            except EtcdError as exc:  # etcd out of reach past the retries, or our lease gone
                log.warning("agent %s: %s", self.options.agent_id, exc)
        self.drain()

    def _work(self, seconds: float) -> None:
        """Handle the assignments that arrive within `seconds`, then check the members."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                what, name, value = self._inbox.get(timeout=left)
            except queue.Empty:
                break
            try:
                self._take(what, name, value)
            except (EtcdError, OSError, ValueError, KeyError) as exc:
                print(f"agent: {what} {name}: {exc}", flush=True)
        try:
            self._start_committed()
        except (EtcdError, OSError, ValueError, KeyError) as exc:
            print(f"agent: starting committed members: {exc}", flush=True)
        self.check_members()

    def drain(self) -> None:
        self._draining = True
        if self.session.lost.is_set():  # nothing of ours is left in etcd to report to
            self._stop_members(grace=self.options.drain_seconds)
            self.close()
            return
        self.etcd.delete(self.keys.agent(self.options.agent_id))
        deadline = time.monotonic() + self.options.drain_seconds
        terminated = False
        while left := [self.members[n].member for n in self.running()]:
            if time.monotonic() > deadline and not terminated:
                for member in left:
                    self.launcher.terminate(member)
                terminated = True
                deadline = time.monotonic() + self.options.drain_seconds
            elif time.monotonic() > deadline:
                for member in left:
                    self.launcher.kill(member)
            self._work(REPORT_SECONDS)  # stops the service asks for still apply
        self.close()

    def close(self) -> None:
        self._watch.cancel()
        self.commits.forget()
        self._http.shutdown()
        self._http.server_close()
        self.session.close(revoke=True)
