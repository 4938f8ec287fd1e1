"""Members on agents: `coordinator agent` processes on any number of hosts.

`reserve` places all of an attempt's members on live agents with free slots
that carry the job's labels (`placement.place`), as one assignment key per
member bound to its agent's lease (keys: `coordinator.keys`; values: `placement.protocol`).
The reconciler writes them in the same transaction that moves the job to
STARTING, guarded by each chosen agent's registration (the same agent, still
alive) and by its assignments (nobody placed members on it since they were read): so two
replicas never over-fill an agent, and a job is placed whole or not at all.

A placement too big for one transaction (`max_txn_ops`, `max_txn_bytes`) is
written ahead by `reserve`, in chunks, and committed by one key
(`ahead`); the leader sweeps what was never committed.

An agent starts what is assigned to it at once, so `start` has nothing left to
do. The member's state is its agent's report; an agent that dies takes its
assignments and reports with its lease, and its members read as `VANISHED`
(they die with it). Stopping a member writes `stop` into its assignment, and
its output comes from its agent over HTTP, with the bearer token of the agent's
registration, read within `OUTPUT_DEADLINE` seconds and `OUTPUT_CAP` bytes whatever
the agent sends (what came by then is the answer). Registrations and reports are
validated (`placement.protocol`): an
agent's address is used only from a live (leased) registration that parses.
The job's etcd credentials travel in the assignment, which only its agent (and
the service) may read. Every assignment, and every change of one (`stop`), is signed
with the service's key for its agent and that agent's registration
(`placement.protocol.signed_assignment`): agents run nothing else.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter

import httpx
from pydantic import ValidationError

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.txn import CreatedAt, KeyValue, Put, QuietSince
from coordinator.keys import Keys, leaf, member_name, of_run, placements_of
from coordinator.service.launchers import OUTPUT_CAP, VANISHED, Launch, Reservation
from coordinator.service.model import JobSpec, Member
from coordinator.service.placement.ahead import PLACEMENT_GRACE, PlacementsAhead
from coordinator.service.placement.chunks import (
    DEFAULT_MAX_TXN_BYTES,
    DEFAULT_MAX_TXN_OPS,
    Write,
    check_limits,
    fits_one_transaction,
)
from coordinator.service.placement.gang import AgentRoom, capacity, matches, place
from coordinator.service.placement.protocol import (
    REGISTRATION,
    AgentRecord,
    Report,
    assignment_payload,
    signed_assignment,
)
from coordinator.signing import SignatureError, Signer

log = logging.getLogger(__name__)

#: Seconds one read of a member's output may take in all, and the most bytes it returns.
OUTPUT_DEADLINE = 2.0
#: Seconds each network operation of such a read may take (connect, send, each read).
OUTPUT_STEP = 0.5


class AgentsLauncher:
    def __init__(
        self,
        etcd: Etcd,
        signer: Signer,
        max_txn_ops: int = DEFAULT_MAX_TXN_OPS,
        max_txn_bytes: int = DEFAULT_MAX_TXN_BYTES,
        placement_grace: float = PLACEMENT_GRACE,
    ) -> None:
        check_limits(max_txn_ops, max_txn_bytes)
        self.ahead = PlacementsAhead(etcd, signer, max_txn_ops, max_txn_bytes, placement_grace)
        self.etcd = etcd
        self.signer = signer
        self.keys = Keys(etcd.namespace)
        # The most operations (and bytes) of one transaction this launcher makes or
        # hands the reconciler: bigger placements are written in chunks.
        self.max_txn_ops = max_txn_ops
        self.max_txn_bytes = max_txn_bytes
        self._http = httpx.Client(timeout=OUTPUT_STEP)
        # agent id -> its output server and token, as last read
        self._addresses: dict[str, tuple[str, str]] = {}

    # -- placing ----------------------------------------------------------------

    def rooms(self) -> tuple[list[AgentRoom], dict[str, KeyValue], int]:
        """The live agents with their slots in use, their registrations, and the
        revision the assignments were read at."""
        registered, _ = self.etcd.get_prefix(self.keys.agents)
        assigned, revision = self.etcd.get_prefix(self.keys.assignments())
        used: Counter[str] = Counter()
        gpus_used: dict[str, set[int]] = {}
        for kv in assigned:
            agent_id, _ = self.keys.assigned(kv.key)
            used[agent_id] += 1
            gpus_used.setdefault(agent_id, set()).update(_assigned_gpus(kv))
        kvs = {}
        rooms = []
        for kv in registered:
            agent_id = leaf(kv.key)
            record = _registration(kv)
            if record is not None:
                kvs[agent_id] = kv
                held = frozenset(gpus_used.get(agent_id, ()))
                rooms.append(
                    AgentRoom(
                        agent_id, record.slots, used[agent_id], record.labels, record.gpus, held
                    )
                )
        return rooms, kvs, revision

    def close(self) -> None:
        return None  # nothing of its own runs: every read is the caller's

    def never_fits(self, spec: JobSpec) -> str | None:
        """Why the live agents could never run this job at once (None: they could)."""
        rooms, _, _ = self.rooms()
        room = capacity(rooms, spec.agent_selector, spec.gpus_per_worker)
        if spec.workers <= room:
            return None
        matching = [r for r in rooms if matches(r, spec.agent_selector)]
        which = f" with labels {spec.agent_selector}" if spec.agent_selector else ""
        if spec.gpus_per_worker > 0:
            gpus = sum(len(r.gpus) for r in matching)
            return (
                f"{spec.workers} workers with {spec.gpus_per_worker} GPU(s) each can never "
                f"fit: the {len(matching)} live agent(s){which} declare {gpus} GPUs and "
                f"room for {room} such workers; start agents with more --gpus or ask for less"
            )
        return (
            f"{spec.workers} workers can never fit: the {len(matching)} live agent(s){which} "
            f"have {room} slots in all; start more agents or ask for fewer workers"
        )

    def reserve(self, launch: Launch) -> Reservation | None:
        rooms, registrations, revision = self.rooms()
        spec = launch.spec
        placed = place(rooms, spec.workers, spec.agent_selector, spec.gpus_per_worker)
        if placed is None:
            return None
        assignments = [
            _assignment(launch, index, gpus, registrations[agent_id].create_revision)
            for index, (agent_id, gpus) in enumerate(placed)
        ]
        members, writes = [], []
        for index, ((agent_id, _), assignment) in enumerate(zip(placed, assignments, strict=True)):
            name = member_name(launch.run_id, launch.attempt, index)
            key = self.keys.assignment(agent_id, name)
            writes.append(
                Write(agent_id, key, signed_assignment(self.signer, agent_id, assignment))
            )
            members.append(Member(index=index, assignment=f"{agent_id}/{name}"))
        if not fits_one_transaction(writes, self.max_txn_ops, self.max_txn_bytes):
            return self.ahead.write(launch, placed, assignments, members, registrations, revision)
        puts = [Put(w.key, w.value, registrations[w.agent_id].lease) for w in writes]
        guards: list[CreatedAt | QuietSince] = []
        for agent_id in sorted({agent_id for agent_id, _ in placed}):
            registration = registrations[agent_id]
            guards.append(CreatedAt(registration.key, registration.create_revision))
            guards.append(QuietSince(self.keys.assignments(agent_id), revision))
        return Reservation(puts=puts, guards=guards, members=members)

    def sweep(self) -> int:
        return self.ahead.sweep()

    def placement_ended(self, run_id: str, attempt: int) -> None:
        self.ahead.ended(run_id, attempt)

    def start(self, launch: Launch, index: int) -> Member:
        """The member as `reserve` placed it (its agent started it on its own)."""
        name = member_name(launch.run_id, launch.attempt, index)
        assigned, _ = self.etcd.get_prefix(self.keys.assignments(), keys_only=True)
        for kv in assigned:
            agent_id, assigned_name = self.keys.assigned(kv.key)
            if assigned_name == name:
                return Member(index=index, assignment=f"{agent_id}/{name}")
        raise RuntimeError(f"member {index} of {launch.run_id} was never placed on an agent")

    # -- following ----------------------------------------------------------------

    def exit_code(self, member: Member) -> int | None:
        agent_id, name = _parts(member)
        try:
            report, assigned = self._report_or_assigned(agent_id, name)
        except EtcdError as exc:
            log.warning("member %s: %s", name, exc)
            return None  # asked again next tick
        if report is not None:
            try:
                state = Report.model_validate_json(report.value)
            except ValidationError as exc:
                log.warning("member %s: a report that does not parse (%s)", name, exc)
                return VANISHED
            if state.state == "running":
                return None
            if state.state == "refused":
                log.warning("member %s: %s", name, state.reason)
            return VANISHED if state.exit_code is None else state.exit_code
        return None if assigned else VANISHED  # assigned, not yet started

    def _report_or_assigned(self, agent_id: str, name: str) -> tuple[KeyValue | None, bool]:
        """The member's report, or (none yet) whether it is still assigned. Plain reads,
        not one read-only transaction (etcd before 3.5.5 panics on one that times out
        under load, etcd#14110; this is asked for every member every tick): its agent
        writes the report with the assignment's deletion, and a deleted assignment never
        comes back, so a report missing before the assignment was found gone is read
        again."""
        report = self.etcd.get(self.keys.report(agent_id, name))
        if report is not None:
            return report, True
        if self.etcd.get(self.keys.assignment(agent_id, name)) is not None:
            return None, True
        return self.etcd.get(self.keys.report(agent_id, name)), False

    def terminate(self, member: Member) -> None:
        self._stop(member, "SIGTERM")

    def kill(self, member: Member) -> None:
        self._stop(member, "SIGKILL")

    def _stop(self, member: Member, signal_name: str) -> None:
        """Ask the member's agent to signal it: `stop` in its assignment (which exists
        only while the member is assigned; a replace never brings it back)."""
        agent_id, name = _parts(member)
        key = self.keys.assignment(agent_id, name)
        try:
            kv = self.etcd.get(key)
            if kv is None:
                return
            # Only what the service signed is signed again: never a value someone else wrote.
            assignment = assignment_payload(self.signer.public, agent_id, kv.value)
            if assignment.get("stop") == "SIGKILL" or assignment.get("stop") == signal_name:
                return
            assignment["stop"] = signal_name
            value = signed_assignment(self.signer, agent_id, assignment)
            self.etcd.replace(key, value, kv.mod_revision, kv.lease)
        except (EtcdError, SignatureError) as exc:
            log.warning("member %s: %s", name, exc)

    def output(self, member: Member, offset: int) -> bytes:
        agent_id, name = _parts(member)
        try:
            found = self._addresses.get(agent_id) or self._address(agent_id)
            if found is None:
                return b""  # the agent is gone, and its member's output with it
            address, token = found
            url = f"http://{address}/members/{name}/output"
            headers = {"Authorization": f"Bearer {token}"}
            status, body = _read_capped(self._http, url, offset, headers)
            if status == 401:
                self._addresses.pop(agent_id, None)  # a new registration: read it again
            return body if status == 200 else b""
        except (EtcdError, httpx.HTTPError) as exc:
            self._addresses.pop(agent_id, None)  # read again: it may have moved
            log.warning("output of %s: %s", name, exc)
            return b""

    def _address(self, agent_id: str) -> tuple[str, str] | None:
        """The agent's output server and its token, from its live registration only."""
        kv = self.etcd.get(self.keys.agent(agent_id))
        record = _registration(kv) if kv is not None else None
        if record is None:
            return None
        self._addresses[agent_id] = (record.address, record.token)
        return record.address, record.token

    def remove(self, run_id: str) -> int:
        """Forget the submission's member reports and placement commits (the agents keep
        their output files)."""
        reports, _ = self.etcd.get_prefix(self.keys.reports(), keys_only=True)
        removed = 0
        for kv in reports:
            if of_run(leaf(kv.key), run_id):
                removed += self.etcd.delete(kv.key)
        return removed + self.ahead.delete_commits(placements_of(run_id))


def _read_capped(
    client: httpx.Client, url: str, offset: int, headers: dict[str, str]
) -> tuple[int, bytes]:
    """GET `url` from `offset`: (status, at most `OUTPUT_CAP` bytes of body) within
    `OUTPUT_DEADLINE` in all. httpx's timeouts bound each network operation, not the
    whole: a server dripping a byte at a time would never trip them. So each operation
    gets `OUTPUT_STEP` and no read starts that could end past the deadline; a read cut
    short gives what came (the follower reads on from there)."""
    deadline = time.monotonic() + OUTPUT_DEADLINE
    body = bytearray()
    params, timeout = {"offset": offset}, httpx.Timeout(OUTPUT_STEP)
    with client.stream("GET", url, params=params, headers=headers, timeout=timeout) as response:
        if response.status_code != 200:
            return response.status_code, b""
        chunks = response.iter_raw()
        while len(body) < OUTPUT_CAP and time.monotonic() + OUTPUT_STEP <= deadline:
            chunk = next(chunks, None)
            if chunk is None:
                break
            body += chunk
    return 200, bytes(body[:OUTPUT_CAP])


def _assignment(
    launch: Launch, index: int, gpus: tuple[int, ...], registration: int
) -> dict[str, object]:
    """What member `index` runs, as its agent (of that registration) reads it
    (`placement.protocol.Assignment`), before it is signed."""
    command = launch.command
    assignment: dict[str, object] = {
        REGISTRATION: registration,
        "run_id": launch.run_id,
        "attempt": launch.attempt,
        "index": index,
        "worker_args": command.options(),
    }
    if command.program is not None:  # the command kind: its agent passes env and folder on
        assignment["command"] = list(command.program)
        if command.program_env:
            assignment["env"] = command.program_env
        if command.working_dir:
            assignment["working_dir"] = command.working_dir
    if gpus:
        assignment["gpus"] = list(gpus)
    if launch.credentials is not None:  # the assignment is readable by its agent only
        assignment["credentials"] = {
            "user": launch.credentials.user,
            "password": launch.credentials.password,
        }
    return assignment


def _registration(kv: KeyValue) -> AgentRecord | None:
    """An agent's registration, if it is live (bound to a lease) and parses."""
    if not kv.lease:
        log.warning("agent key %s is not bound to a lease: ignored", kv.key)
        return None
    try:
        return AgentRecord.model_validate_json(kv.value)
    except ValidationError as exc:
        log.warning("agent key %s does not parse: ignored (%s)", kv.key, exc)
        return None


def _assigned_gpus(kv: KeyValue) -> list[int]:
    """The GPU ids an assignment holds (none when it names none, or does not parse: an
    assignment is the service's own writing, checked again by its agent)."""
    try:
        gpus = json.loads(kv.value).get("gpus", [])
    except (ValueError, AttributeError):
        return []
    if not isinstance(gpus, list):
        return []
    return [g for g in gpus if isinstance(g, int) and not isinstance(g, bool)]


def _parts(member: Member) -> tuple[str, str]:
    assert member.assignment is not None
    agent_id, _, name = member.assignment.partition("/")
    return agent_id, name
