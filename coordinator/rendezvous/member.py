"""One member of a job's rendezvous: the seed protocol's phases on etcd v3.

Phases, in order (seed name in brackets where it differs):

- `leader_election`: claim the smallest free ordinal; rank 0 leads. Ends when
  all N ranks are held.
- `ip_exchange`: publish this member's address; the leader writes the roster.
- `connect` [ssh]: the leader checks that it reaches every member's endpoint,
  each member the leader's, with a mutual proof of the round's secret (the
  roster carries it: `handshake`).
- `barrier(name)`, e.g. `training`: nobody passes before all N arrive.
- `cleaner`: a last barrier, then every member leaves and the last one out
  deletes the job's rendezvous keys.

Every key is bound to the member's lease, so a crashed member's keys vanish
and the others see a deletion. Every wait listens for three things at once: its
own condition (one key, or a prefix the leader alone watches), deletions of
member keys (a member lost), and the loss of its own lease; and it has a
deadline. Keys written after the election carry the round (the leader key's
create revision), so nothing left from an earlier round can satisfy a wait.

It is long because it is one state machine: the phases share the session, the
liveness watch, the losses seen so far and one wait loop (`_wait`), and split
apart they would have to hand all of that around. What stands alone does
already: the keys, the roster, the handshake, the endpoint, the errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import wraps
from typing import Any, TypeVar

from pydantic import ValidationError

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import LeaseNotFound
from coordinator.etcd.names import check_name
from coordinator.etcd.session import Session
from coordinator.etcd.values import json_object
from coordinator.etcd.watch import Watch, WatchEvent
from coordinator.keys import JobKeys, rank_of
from coordinator.rendezvous import handshake
from coordinator.rendezvous.address import advertise_address
from coordinator.rendezvous.endpoint import MemberEndpoint, probe
from coordinator.rendezvous.errors import (
    JobFull,
    MemberLost,
    RendezvousError,
    RendezvousTimeout,
    SessionLost,
    Unreachable,
)
from coordinator.rendezvous.roster import (
    ROSTER_LIMIT_BYTES,
    MemberAddress,
    Roster,
    RosterFormatError,
    check_world_size,
)

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def fenced(phase_method: F) -> F:
    """etcd refusing a write for a lost lease means this member is out: say so."""

    @wraps(phase_method)
    def wrapper(self: Member, *args: Any, **kwargs: Any) -> Any:
        try:
            return phase_method(self, *args, **kwargs)
        except LeaseNotFound as exc:
            raise SessionLost(
                f"this member's etcd lease is gone (etcd refused a write) during phase "
                f"'{self.phase}'; stopping instead of acting on a stale view"
            ) from exc

    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class PhaseRecord:
    """When this member entered a phase's wait and when it passed (wall clock)."""

    phase: str
    arrived: float
    passed: float


class Member:
    """Use as a context manager, or call `close()` (with the error, if any) at the end."""

    def __init__(
        self,
        etcd: Etcd,
        job_id: str,
        world_size: int,
        *,
        ttl: int = 10,
        timeout: float = 300.0,
        address: str | None = None,
        port: int = 0,
        member_id: str | None = None,
    ) -> None:
        check_world_size(world_size)
        self.etcd = etcd
        self.job_id = check_name("job id", job_id)
        self.world_size = world_size
        self.ttl = ttl
        self.timeout = timeout
        self.member_id = member_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.keys = JobKeys(etcd.namespace, job_id)
        self.phase = "init"
        self.rank: int | None = None
        self.round = 0
        self.roster: Roster | None = None
        self.timeline: list[PhaseRecord] = []
        self.cleaned_up = False  # True on the member that deleted the job's keys
        self.roster_written_at: float | None = None  # on the leader: when (wall clock)
        self.roster_bytes = 0  # on the leader: the size of the roster it wrote
        self._address = address
        self._port = port
        self._session: Session | None = None
        self._endpoint: MemberEndpoint | None = None
        self._liveness: Watch | None = None
        self._inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._trouble = threading.Event()  # a member or our lease is lost: stop retrying
        # rank -> (its last state, our phase when we saw it go); kept, so a loss seen
        # during a wait that still succeeded fails every later wait at once.
        self._lost: dict[int, tuple[dict[str, Any], str]] = {}
        self._barrier_uses: Counter[str] = Counter()
        # Lost ranks the job carries on without (see `carry_on_without_lost`).
        self._excused: set[int] = set()
        self._tolerate_loss = False
        self._wait_token = 0
        self._loss_listeners: list[Callable[[int, str], None]] = []
        self._trouble_listeners: list[Callable[[RendezvousError], None]] = []

    # -- the phases -------------------------------------------------------

    def rendezvous(self) -> Roster:
        """leader_election, ip_exchange and connect: afterwards every member holds the roster."""
        self.leader_election()
        roster = self.ip_exchange()
        self.connect()
        return roster

    @fenced
    def leader_election(self) -> int:
        self.phase = "leader_election"
        arrived = time.time()
        self._session = session = Session(self.etcd, self.ttl)
        session.on_lost(self._on_session_lost)
        lease = session.lease_id
        info = json.dumps(
            {"member_id": self.member_id, "host": socket.gethostname(), "pid": os.getpid()}
        )

        # Arrival order gives each member a first guess at its ordinal, so N
        # members make N claims instead of N^2 when they all start together. The
        # count comes with the write, in one transaction, and is a number, not the
        # keys: N members reading the arrivals ahead of them would cost N^2.
        _, arrived_count = self.etcd.put_and_count(
            self.keys.arrival(self.member_id), info, lease, self.keys.arrivals
        )
        ahead = arrived_count - 1
        if ahead >= self.world_size:
            raise JobFull(
                f"job '{self.job_id}' already has {self.world_size} members "
                f"(keys of a crashed earlier run expire within their {self.ttl}s lease)"
            )
        rank, claim, count = self._claim(ahead, info, lease)
        self.rank = rank
        # Which member keys a compaction must not hide the deletion of is known once
        # the set is complete (`expect` below), so the watch need not read them now.
        self._liveness = self.etcd.watch(
            self.keys.members,
            self._on_member_deleted,
            start_revision=claim.create_revision + 1,
            prefix=True,
            only_deletes=True,
            known_keys=(),
        )
        if count >= self.world_size:  # this claim completed the set: announce it
            leader = self.etcd.get(self.keys.member(0))
            if leader is not None:  # (else rank 0 is already lost, and all hear of it)
                elected = {"round": leader.create_revision, "complete_at": claim.create_revision}
                self.etcd.put(self.keys.elected, json.dumps(elected), lease)

        def is_mine(value: bytes) -> int | None:
            """The round, if the set announced includes our claim: it was complete at a
            revision after our claim, and our key has not vanished since (we would have
            heard). An announcement of an earlier round was complete before it."""
            elected = json_object(value)
            complete_at, round_ = elected.get("complete_at"), elected.get("round")
            if not isinstance(complete_at, int) or not isinstance(round_, int):
                return None
            return round_ if complete_at >= claim.create_revision else None

        self.round = self._wait(
            self.keys.elected,
            claim.create_revision,
            on_events=lambda events: _first(is_mine(e.value) for e in events if e.kind == "put"),
            recheck=lambda: _maybe(self.etcd.get(self.keys.elected), lambda kv: is_mine(kv.value)),
            missing=lambda: self._missing_ranks(self.keys.members),
        )
        self._liveness.expect(self.keys.member(r) for r in range(self.world_size))
        self._record(arrived)
        return rank

    def _claim(self, first_guess: int, info: str, lease: int) -> tuple[int, Any, int]:
        guess = first_guess
        for _ in range(self.world_size + 1):
            created, current, count = self.etcd.create(
                self.keys.member(guess), info, lease, count_prefix=self.keys.members
            )
            if created:
                return guess, current, count
            free = self._missing_ranks(self.keys.members)
            if not free:
                break
            guess = free[0]
        raise JobFull(f"job '{self.job_id}': all {self.world_size} ranks are taken")

    def _missing_ranks(self, prefix: str) -> list[int]:
        """Ranks with no key under `prefix` (keys end in the rank)."""
        present = {rank_of(kv.key) for kv in self.etcd.get_prefix(prefix)[0]}
        return sorted(set(range(self.world_size)) - present)

    @fenced
    def ip_exchange(self) -> Roster:
        self.phase = "ip_exchange"
        arrived = time.time()
        rank, lease = self._require_rank(), self._lease()
        host = advertise_address(self.etcd.endpoints, self._address)
        try:  # the advertised address only, never all interfaces
            self._endpoint = endpoint = MemberEndpoint(
                self.job_id,
                self.member_id,
                host,
                self._port,
                idle_timeout=self.timeout,
                max_connections=2 * self.world_size + 16,  # every peer twice, and probes
            )
        except OSError as exc:
            raise RendezvousError(
                f"cannot listen on the advertised address {host} port {self._port}: {exc} "
                "(advertise an address of this host)"
            ) from exc
        me = MemberAddress(
            rank=rank,
            member_id=self.member_id,
            host=host,
            port=self._endpoint.port,
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )
        revision = self.etcd.put(self.keys.address(rank), me.model_dump_json(), lease)

        if rank == 0:
            self._publish_roster()

        def is_ours(value: bytes) -> Roster | None:
            roster = read_roster(value)
            return roster if self._is_this_rounds(roster) else None

        self.roster = self._wait(
            self.keys.roster,
            revision,
            on_events=lambda events: _first(is_ours(e.value) for e in events if e.kind == "put"),
            recheck=lambda: _maybe(self.etcd.get(self.keys.roster), lambda kv: is_ours(kv.value)),
            missing=lambda: self._missing_ranks(self.keys.addresses) or "the leader's roster",
        )
        # Callers must now prove this round's secret (a prompt one waited for it).
        endpoint.authorize(self.roster.secret_bytes, self.round)
        self._record(arrived)
        return self.roster

    def _is_this_rounds(self, roster: Roster) -> bool:
        return (roster.job_id, roster.round, roster.world_size) == (
            self.job_id,
            self.round,
            self.world_size,
        )

    def _publish_roster(self) -> None:
        """The leader collects all N addresses, then writes the roster once."""
        addresses: dict[int, MemberAddress] = {}

        def take(values: list[bytes]) -> dict[int, MemberAddress] | None:
            for value in values:
                address = MemberAddress.model_validate_json(value)
                if address.rank < self.world_size:
                    addresses[address.rank] = address
            return addresses if len(addresses) == self.world_size else None

        current, revision = self.etcd.get_prefix(self.keys.addresses)
        if take([kv.value for kv in current]) is None:
            self._wait(
                self.keys.addresses,
                revision + 1,
                on_events=lambda events: take([e.value for e in events if e.kind == "put"]),
                recheck=lambda: None,
                missing=lambda: sorted(set(range(self.world_size)) - set(addresses)),
                prefix=True,
            )
        roster = Roster(
            job_id=self.job_id,
            round=self.round,
            world_size=self.world_size,
            members=[addresses[r] for r in range(self.world_size)],
            secret=handshake.new_secret().hex(),  # a new round, a new secret
        )
        value = roster.packed()
        if len(value) > ROSTER_LIMIT_BYTES:
            raise RendezvousError(
                f"job '{self.job_id}': the roster of {self.world_size} members packs to "
                f"{len(value)} bytes, above the {ROSTER_LIMIT_BYTES} one etcd request may carry "
                "(member ids or host names are unusually long; shorten them)"
            )
        created, current_kv, _ = self.etcd.create(self.keys.roster, value, self._lease())
        self.roster_written_at, self.roster_bytes = time.time(), len(value)
        if not created:
            other = read_roster(current_kv.value).round
            raise RendezvousError(
                f"job '{self.job_id}': a roster of round {other} already exists "
                f"(this is round {self.round}); it expires with its leader's lease"
            )

    @fenced
    def connect(self) -> None:
        """[ssh] The leader proves it reaches every member, and each member the leader;
        then all pass together."""
        self.phase = "connect"
        roster = self._require_roster()
        if self.rank == 0:
            deadline = time.monotonic() + self.timeout
            with ThreadPoolExecutor(max_workers=min(32, roster.world_size)) as pool:
                problems = pool.map(
                    lambda m: probe(
                        m.host, m.port, roster.key_for(m), deadline, self._trouble.is_set
                    ),
                    roster.members,
                )
                failed = [
                    f"rank {m.rank} at {m.host}:{m.port} ({problem})"
                    for m, problem in zip(roster.members, problems, strict=True)
                    if problem is not None
                ]
            if failed and not self._trouble.is_set():  # else the wait below says who was lost
                raise Unreachable("the leader cannot reach " + "; ".join(failed))
        else:
            # And back: services a job starts on the leader (XGBoost's tracker) live there.
            leader = roster.leader
            deadline = time.monotonic() + self.timeout
            problem = probe(
                leader.host, leader.port, roster.key_for(leader), deadline, self._trouble.is_set
            )
            if problem is not None and not self._trouble.is_set():
                raise Unreachable(
                    f"rank {self.rank} cannot reach the leader at {leader.host}:{leader.port} "
                    f"({problem})"
                )
        self._barrier("connect")

    @fenced
    def barrier(
        self, name: str, timeout: float | None = None, ranks: frozenset[int] | None = None
    ) -> None:
        """Wait until all N members (or only `ranks`, which then must be the only ones
        to call it) have called `barrier(name)` the same number of times (for at most
        `timeout` seconds, inf for no deadline; default the phase timeout). Losing any
        member fails it, whether among `ranks` or not."""
        self._barrier(check_name("barrier name", name), timeout, ranks)

    def _barrier(
        self, name: str, timeout: float | None = None, ranks: frozenset[int] | None = None
    ) -> None:
        self.phase = name
        arrived = time.time()
        rank, lease = self._require_rank(), self._lease()
        self._require_roster()
        among = frozenset(range(self.world_size)) if ranks is None else ranks

        def expected() -> int:
            return len(among - self._excused)

        use = self._barrier_uses[name]
        self._barrier_uses[name] += 1
        keys = self.keys.barrier(self.round, name, use)
        revision, count = self.etcd.put_and_count(
            keys.arrival(rank), json.dumps({"t": arrived}), lease, keys.arrived
        )
        if count >= expected():  # the last arrival opens the gate
            self.etcd.put(keys.ready, str(self.round), lease)

        def recheck() -> bool | None:
            if self.etcd.get(keys.ready):
                return True
            # A member we carry on without has gone: the rest may now be complete.
            if self._excused and self.etcd.count_prefix(keys.arrived) >= expected():
                self.etcd.put(keys.ready, str(self.round), lease)
                return True
            return None

        self._wait(
            keys.ready,
            revision,
            on_events=lambda events: True if any(e.kind == "put" for e in events) else None,
            recheck=recheck,
            missing=lambda: [r for r in self._missing_ranks(keys.arrived) if r in among],
            timeout=timeout,
        )
        self._record(arrived)

    @fenced
    def cleaner(self) -> None:
        """Last barrier; then leave, and the last member out deletes the job's keys."""
        self._barrier("cleaner")
        self._stop_liveness()
        session = self._session
        assert session is not None
        # Say we left on purpose, so a member still waiting for this barrier's
        # gate knows the gate opened even if it sees our departure first.
        self.etcd.put(
            self.keys.member(self._require_rank()), json.dumps({"state": "left"}), session.lease_id
        )
        session.close(revoke=True)
        self._session = None
        if self.etcd.count_prefix(self.keys.members) == 0:
            self.etcd.delete_prefix(self.keys.rendezvous)
            self.cleaned_up = True
        self.phase = "done"
        self.close()

    # -- waiting ----------------------------------------------------------

    def _on_member_deleted(self, events: list[WatchEvent]) -> None:
        for event in events:
            state = json_object(event.prev_value)
            rank = rank_of(event.key)
            # Leaving is normal only after the cleaner barrier, which we are then in.
            if state.get("state") != "left" or self.phase != "cleaner":
                if self._tolerate_loss:
                    self._excused.add(rank)
                else:
                    self._lost.setdefault(rank, (state, self.phase))
                    self._report_trouble(MemberLost(rank, self.phase, loss_reason(state)))
                for listener in self._loss_listeners:
                    listener(rank, loss_reason(state))
            self._inbox.put(("member", rank, state))

    def _on_session_lost(self, reason: str) -> None:
        self._report_trouble(SessionLost(f"this member's etcd lease is lost ({reason})"))
        self._inbox.put(("session", reason))

    def _report_trouble(self, error: RendezvousError) -> None:
        first = not self._trouble.is_set()
        self._trouble.set()
        if first:
            for listener in self._trouble_listeners:
                listener(error)

    def _wait(
        self,
        key: str,
        start_revision: int,
        *,
        on_events: Callable[[list[WatchEvent]], T | None],
        recheck: Callable[[], T | None],
        missing: Callable[[], list[int] | str],
        prefix: bool = False,
        timeout: float | None = None,
    ) -> T:
        """Block until `on_events` returns a value, a member is lost, or the deadline.

        `recheck` reads the condition directly; it settles races between a
        member's departure and the event that would have let us pass.
        """
        self._raise_if_lost()
        self._wait_token += 1
        token = self._wait_token
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        watch = self.etcd.watch(
            key,
            lambda events: self._inbox.put(("events", token, events)),
            start_revision,
            prefix=prefix,
        )
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RendezvousTimeout(self.phase, timeout, missing())
                try:  # an hour at most per get: a wait without deadline has remaining = inf
                    item = self._inbox.get(timeout=min(remaining, 3600.0))
                except queue.Empty:
                    continue
                kind = item[0]
                if kind == "events" and item[1] == token:
                    result = on_events(item[2])
                    if result is not None:
                        return result
                elif kind == "session":
                    raise SessionLost(
                        f"this member's etcd lease is lost ({item[1]}) during phase "
                        f"'{self.phase}'; stopping instead of acting on a stale view"
                    )
                elif kind == "member":
                    _, rank, state = item
                    if rank == self.rank:
                        raise SessionLost(f"this member's rank key vanished during '{self.phase}'")
                    if state.get("state") == "left" and self.phase == "cleaner":
                        return recheck() or True  # type: ignore[return-value]
                    result = recheck()
                    if result is not None:
                        return result
                    self._raise_if_lost()
        finally:
            watch.cancel()

    # -- for jobs that wait on keys of their own (step barriers) ----------

    @property
    def lease_id(self) -> int:
        """This member's lease: a job binds its own keys to it so they die with the member."""
        return self._lease()

    def on_session_lost(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` once when this member's own lease is lost."""
        if self._session is None:
            raise RendezvousError("this member has no session (not joined, or already left)")
        self._session.on_lost(listener)

    def on_member_lost(self, listener: Callable[[int, str], None]) -> None:
        """Call `listener(rank, reason)` (from a watch thread; be quick) for each member lost
        from now on, excused or not: for a job that must act on a loss while it trains."""
        self._loss_listeners.append(listener)

    def on_trouble(self, listener: Callable[[RendezvousError], None]) -> None:
        """Call `listener(error)` (from a watch thread; be quick) once, when the job first
        cannot go on: a member lost that is not excused, or this member's own lease lost."""
        self._trouble_listeners.append(listener)

    def serve(
        self, handler: Callable[[socket.socket], None], idle_timeout: float | None = None
    ) -> None:
        """Hand connections to this member's roster endpoint to `handler` after the handshake
        (one thread each): how a job offers a service at the address the others know.
        A connection silent for `idle_timeout` (default: the phase timeout) is dropped."""
        if self._endpoint is None:
            raise RendezvousError("ip_exchange must come before serving on the endpoint")
        if idle_timeout is not None:
            self._endpoint.idle_timeout = idle_timeout
        self._endpoint.handler = handler

    def carry_on_without_lost(self) -> None:
        """From now on a lost member leaves the job instead of failing it: later barriers
        wait only for the others (a step job's `on_loss=continue`)."""
        self._tolerate_loss = True
        self._excused.update(self._lost)
        self._lost.clear()

    def wait_for_loss(self, timeout: float) -> MemberLost | None:
        """The first member lost, waiting up to `timeout` for one to be noticed.

        For code that failed outside etcd (a collective's socket closed): the
        dead member's lease ends within a TTL, and its key says who it was.
        """
        self._trouble.wait(timeout)
        if not self._lost:
            return None
        rank, (state, phase) = next(iter(self._lost.items()))
        return MemberLost(rank, phase, loss_reason(state))

    def losses(self) -> dict[int, dict[str, Any]]:
        """Each member lost so far (not excused), with its last state (`loss_reason`)."""
        return {rank: dict(state) for rank, (state, _) in list(self._lost.items())}

    def _raise_if_lost(self) -> None:
        if self._lost:
            rank, (state, phase) = next(iter(self._lost.items()))
            raise MemberLost(rank, phase, loss_reason(state))

    # -- bookkeeping ------------------------------------------------------

    def _record(self, arrived: float) -> None:
        self.timeline.append(PhaseRecord(self.phase, arrived, time.time()))

    def _require_rank(self) -> int:
        if self.rank is None:
            raise RendezvousError("leader_election must come first")
        return self.rank

    def _require_roster(self) -> Roster:
        if self.roster is None:
            raise RendezvousError("ip_exchange must come before connect and barriers")
        return self.roster

    def _lease(self) -> int:
        if self._session is None:
            raise RendezvousError("this member has no session (not joined, or already left)")
        if self._session.lost.is_set():
            raise SessionLost(f"this member's etcd lease is lost ({self._session.lost_reason})")
        return self._session.lease_id

    def _stop_liveness(self) -> None:
        if self._liveness is not None:
            self._liveness.cancel()
            self._liveness = None

    def close(self, error: BaseException | None = None) -> None:
        """Leave: tell the others why if we failed, then drop our keys with the lease."""
        self._stop_liveness()
        session, self._session = self._session, None
        if session is not None:
            if error is not None and self.rank is not None and not session.lost.is_set():
                state = {"state": "failed", "phase": self.phase, "reason": str(error)}
                # Best effort: the lease revocation below tells them in any case.
                with contextlib.suppress(Exception):
                    self.etcd.put(self.keys.member(self.rank), json.dumps(state), session.lease_id)
            session.close(revoke=True)
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None

    def __enter__(self) -> Member:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(exc)


def read_roster(value: bytes) -> Roster:
    """A roster from etcd; one that does not parse stops the member, naming the field."""
    try:
        return Roster.from_etcd(value)
    except RosterFormatError as exc:  # names the part, never the value
        raise RendezvousError(f"the job's roster in etcd is malformed: {exc}") from None
    except ValidationError as exc:  # never the input: it may hold the secret
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False)
        )
        raise RendezvousError(f"the job's roster in etcd is malformed: {problems}") from None


def loss_reason(state: dict[str, Any]) -> str:
    """Why a member key vanished, from its last state (a failure records its reason)."""
    if state.get("state") == "failed":
        return f"it failed in phase '{state.get('phase')}': {state.get('reason')}"
    if state.get("state") == "left":
        return "it finished and left, so its barrier sequence differs from this member's"
    return "its lease ended (the process died or lost contact with etcd)"


def _first(values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _maybe(kv: Any, read: Callable[[Any], T | None]) -> T | None:
    return None if kv is None else read(kv)
