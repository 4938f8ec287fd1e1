"""The step barrier on etcd: each worker's clock is a key bound to its lease.

Keys, under `<ns>/jobs/<job>/steps/`:

- `<round>/clocks/<rank>` (ASP, PSP, DSSP): `{"clock", "t", "interval",
  "done"}`: completed steps, wall time of the last push, the mean of recent
  step intervals (what DSSP predicts from), and whether the worker has
  finished. Leased, so a dead worker's clock vanishes and the others see it.
- `<round>/order/<clock>/<rank>` (BSP, SSP): the same value, leased; one key
  per worker, moved up at every step, so the lowest key is the slowest
  worker. A finished worker's key moves to the top (`DONE`), where it
  constrains nobody.
- `<round>/slowest`: the job-wide slowest clock (BSP, SSP), raised by the one
  worker that leaves the lowest level last.
- `dssp/<rank>`: DSSP's credit (`remaining`, `granted_this_episode`). Not
  leased and not per round, so a restarted member continues its episode.

Decisions are `policy.may_start` and `dssp.decide`; this module only gathers
the clocks they need, and waits with watches, never by polling:

- BSP and SSP need only the slowest clock. Each step is one transaction: move
  the order key up, read the lowest order key; if this worker
  was alone at the lowest level, the same transaction raises `slowest`.
  Everyone keeps one watch on `slowest`, so a step costs each worker one
  request and one notification, whatever P is (watching every clock would
  cost P notifications per worker per step).
- DSSP needs every clock (its controller predicts from the slowest worker's
  push times and asks who is fastest): one watch on the clocks prefix for the
  whole run keeps a local view, so a check costs no reads at all.
- pBSP and pSSP draw one sample of beta live peers per step (`PER_STEP`), read
  those beta keys (one request), and if they must wait, watch only those keys:
  O(beta) keys read and watched per check, whatever P is.
- ASP reads nothing.

Only the `participants` step (all members by default; a parameter-server job's
trainers): the others publish no clock, and losing one of them always fails the
steps, since nothing can go on without it.

A finished worker (`done`) no longer constrains anyone: nothing it will do can
change, so waiting for it would hang (the early-finisher pitfall of seed 000).
A lost peer (its lease ended) fails the step with `MemberLost` naming it, or,
with `OnLoss.CONTINUE`, leaves the barrier set and the rest carry on.
"""

from __future__ import annotations

import json
import queue
import random
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from coordinator.barriers.dssp import Credit, Pushes, decide, extra_steps
from coordinator.barriers.policy import BarrierSpec, Method, draw_sample, may_start
from coordinator.etcd.client import (
    Delete,
    First,
    Get,
    KeyValue,
    LeaseNotFound,
    Put,
    Watch,
    prefix_end,
)
from coordinator.rendezvous.errors import MemberLost, RendezvousTimeout, SessionLost
from coordinator.rendezvous.member import Member, loss_reason, member_state, rank_of

DONE = 10**12 - 1  # the order level of a finished worker: above every clock
LEVEL_DIGITS = 12


class OnLoss(StrEnum):
    FAIL = "fail"  # a lost peer fails the job at once, naming it
    CONTINUE = "continue"  # a lost peer leaves the barrier set; the rest carry on


@dataclass(frozen=True)
class Clock:
    """One worker's published state."""

    clock: int
    t: float = 0.0
    interval: float = 0.0
    done: bool = False

    @classmethod
    def parse(cls, value: bytes) -> Clock:
        data = json.loads(value)
        return cls(int(data["clock"]), data["t"], data["interval"], bool(data["done"]))

    def dump(self) -> str:
        return json.dumps(
            {"clock": self.clock, "t": self.t, "interval": self.interval, "done": self.done}
        )


@dataclass(frozen=True)
class Passage:
    """What a worker saw when it passed the barrier before step `clock + 1`."""

    clock: int
    slowest: int | None  # the slowest clock the decision relied on (BSP/SSP: job-wide, self too)
    observed: dict[int, int]  # rank -> clock, the unfinished peers read (PSP sample, DSSP view)
    waited: float  # seconds spent waiting


@dataclass(frozen=True)
class _Sample:
    """A check's sampled peers and their clock keys as read (None: gone) at `revision`."""

    ranks: list[int]
    answers: list[KeyValue | None]
    revision: int


@dataclass
class _Counters:
    checks: int = 0
    reads: int = 0
    watches: int = 0
    waits: int = 0
    rereads: int = 0  # sampled clocks read again: their watch registered after the first read
    lost: list[int] = field(default_factory=list)


class LiveBarrier:
    """One worker's side of a step barrier; call `start`, then `wait_turn`/`complete` per step."""

    def __init__(
        self,
        member: Member,
        spec: BarrierSpec,
        *,
        on_loss: OnLoss = OnLoss.FAIL,
        start_clock: int = 0,
        seed: int | None = None,
        timeout: float | None = None,
        participants: Iterable[int] | None = None,
    ) -> None:
        self.spec = spec.validate()
        self.member = member
        self.etcd = member.etcd
        if member.rank is None:
            raise ValueError("the member must have joined (rendezvous) before a step barrier")
        self.rank: int = member.rank
        self.on_loss = on_loss
        self.timeout = member.timeout if timeout is None else timeout
        self.root = member.keys.job + "steps/"
        self.round_prefix = f"{self.root}{member.round}/"
        self.prefix = f"{self.round_prefix}clocks/"
        self.clock = start_clock
        # The ranks that step (a parameter server's trainers); the others never publish a
        # clock, and losing one of them fails the steps whatever `on_loss` says.
        self.participants = frozenset(
            range(member.world_size) if participants is None else participants
        )
        if self.rank not in self.participants:
            raise ValueError(f"rank {self.rank} is not among the barrier's participants")
        self.live = set(self.participants) - {self.rank}  # peers still in the set
        self.counters = _Counters()
        self._rng = random.Random(seed if seed is not None else member.round * 100003 + self.rank)
        self._intervals: deque[float] = deque(maxlen=5)
        self._last_push = time.time()
        self._view: dict[int, Clock] = {}  # every peer's clock (full-view methods)
        self._inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._token = 0
        self._watches: list[Watch] = []
        self._credit = Credit()
        self._by_slowest = spec.method in (Method.BSP, Method.SSP)
        self._full_view = spec.method == Method.DSSP
        self._level: int | None = None  # this worker's order level (BSP/SSP)
        self._slowest = -1  # the highest job-wide slowest clock known (BSP/SSP)
        # pBSP/pSSP: the next check's sample, drawn and read when the step completed.
        self._next_sample: _Sample | None = None

    # -- keys -------------------------------------------------------------

    def clock_key(self, rank: int) -> str:
        return f"{self.prefix}{rank:06d}"

    def order_prefix(self) -> str:
        return f"{self.round_prefix}order/"

    def level_prefix(self, level: int) -> str:
        return f"{self.order_prefix()}{level:0{LEVEL_DIGITS}d}/"

    def order_key(self, level: int, rank: int) -> str:
        return f"{self.level_prefix(level)}{rank:06d}"

    def _lowest(self) -> First:
        """The read of the lowest order key: the slowest worker."""
        return First(self.order_prefix(), prefix_end(self.order_prefix()))

    def slowest_key(self) -> str:
        return f"{self.round_prefix}slowest"

    def credit_key(self) -> str:
        return f"{self.root}dssp/{self.rank:06d}"

    # -- lifecycle --------------------------------------------------------

    def start(self) -> None:
        """Publish the start clock, then the start barrier: everyone begins together."""
        revision = self._publish(done=False)
        # Any loss from here on is seen: the member's own barrier covers the time before.
        self._watches.append(
            self.etcd.watch(
                self.member.keys.members,
                lambda events: self._inbox.put(("members", events)),
                revision + 1,
                prefix=True,
                only_deletes=True,
            )
        )
        self.member.on_session_lost(lambda reason: self._inbox.put(("session", reason)))
        self.member.barrier("steps-start")
        if self.spec.method == Method.DSSP:
            kv = self.etcd.get(self.credit_key())
            if kv is not None:
                data = json.loads(kv.value)
                self._credit = Credit(data["remaining"], data["granted_this_episode"])
        if self._by_slowest:
            # Everyone has published by now, so the lowest order key is exact.
            revision = self._refresh_slowest()
            self._watches.append(
                self.etcd.watch(
                    self.slowest_key(), lambda events: self._inbox.put(("slowest", events)),
                    revision + 1,
                )
            )  # fmt: skip
        if self._full_view:
            clocks, revision = self.etcd.get_prefix(self.prefix)
            for kv in clocks:
                self._view[rank_of(kv.key)] = Clock.parse(kv.value)
            for rank in sorted(self.live - set(self._view)):
                self._peer_lost(rank, "its clock vanished before the first step")
            self._watches.append(
                self.etcd.watch(
                    self.prefix, lambda events: self._inbox.put(("view", events)), revision + 1,
                    prefix=True,
                )
            )  # fmt: skip

    def complete(self) -> None:
        """One more step done: publish the new clock (one put)."""
        now = time.time()
        self._intervals.append(now - self._last_push)
        self._last_push = now
        self.clock += 1
        if self.spec.sampled:
            # The next check's sample, read in the request that publishes this clock.
            self._publish(False, draw_sample(self._rng, sorted(self.live), self.spec.sample))
        else:
            self._publish(done=False)

    def finish(self) -> None:
        """Say this worker is done, so nobody waits for it, and stop watching."""
        self._publish(done=True)
        self.close()

    def close(self) -> None:
        for watch in self._watches:
            watch.cancel()
        self._watches.clear()

    def _publish(self, done: bool, sample: list[int] | None = None) -> int:
        """Publish this worker's clock; with `sample`, read those clocks in the same request."""
        value = Clock(self.clock, self._last_push, self._mean_interval(), done).dump()
        lease = self.member.lease_id
        try:
            if self._by_slowest:
                return self._move_up(value, done)
            if not sample:
                return self.etcd.put(self.clock_key(self.rank), value, lease)
            reads = [Get(self.clock_key(rank)) for rank in sample]
            result = self.etcd.transaction([Put(self.clock_key(self.rank), value, lease), *reads])
            self._next_sample = _Sample(sample, result.reads, result.revision)
            return result.revision
        except LeaseNotFound as exc:
            raise SessionLost("this member's etcd lease is gone (etcd refused its clock)") from exc

    def _move_up(self, clock: str, done: bool) -> int:
        """Move this worker's order key up to its new clock, in one transaction.

        The lowest order key is the slowest worker. Only the worker that was
        alone at the lowest level can raise the job's slowest clock, so it, and
        only it, writes `slowest` (in the same transaction when the new minimum
        is the next clock, as it always is under BSP; with a second put when the
        rest had already moved further).
        """
        level = DONE if done else self.clock
        lease = self.member.lease_id
        moved = [Put(self.order_key(level, self.rank), clock, lease), self._lowest()]
        old = self._level
        if old is None:
            result = self.etcd.transaction(moved)
        else:
            mine = self.order_key(old, self.rank)
            moved.insert(1, Delete(mine))
            below_me = (self.order_prefix(), mine.encode())
            beside_me = (mine + "\0", prefix_end(self.level_prefix(old)))
            raise_it = Put(self.slowest_key(), str(old + 1))
            result = self.etcd.transaction(
                [*moved, raise_it], when_empty=[below_me, beside_me], otherwise=moved
            )
        self._level = level
        lowest = self._level_of(result.reads[0])
        if result.succeeded and old is not None and lowest > old + 1:
            self.etcd.put(self.slowest_key(), str(lowest))
        self._slowest = max(self._slowest, lowest)
        return result.revision

    def _level_of(self, kv: KeyValue | None) -> int:
        return int(kv.key[len(self.order_prefix()) :].split("/")[0]) if kv is not None else DONE

    def _refresh_slowest(self) -> int:
        """Read the lowest order key (after the start barrier, or after a loss)."""
        result = self.etcd.transaction([self._lowest()])
        self._slowest = max(self._slowest, self._level_of(result.reads[0]))
        return result.revision

    # -- the decision -----------------------------------------------------

    def wait_turn(self) -> Passage:
        """Block until this worker may start step `clock + 1`, as the method says."""
        started = time.monotonic()
        self._drain()
        if self.spec.method == Method.ASP:
            passage = Passage(self.clock, None, {}, 0.0)
        elif self._by_slowest:
            passage = self._wait_slowest(started)
        elif self._full_view:
            passage = self._wait_full(started)
        else:
            passage = self._wait_sampled(started)
        self.counters.checks += 1
        return passage

    def _unfinished(self) -> dict[int, Clock]:
        return {r: c for r, c in self._view.items() if r in self.live and not c.done}

    def _decide_full(self) -> dict[int, int] | None:
        """The clocks passed on, or None to wait (BSP/SSP: may_start; DSSP: decide)."""
        others = self._unfinished()
        observed = {r: c.clock for r, c in others.items()}
        if self.spec.method != Method.DSSP:
            return observed if may_start(self.clock, observed.values(), self.spec.bound) else None
        if not others:
            return observed
        slow_rank = min(others, key=lambda r: (others[r].clock, r))
        slowest = others[slow_rank]
        is_fastest = self.clock >= max(c.clock for c in others.values())
        grant = 0
        s_low, s_high = self.spec.staleness, self.spec.staleness_upper
        if is_fastest and self.clock - slowest.clock > s_low:
            me = Pushes(self.clock, self._last_push, self._mean_interval())
            them = Pushes(slowest.clock, slowest.t, slowest.interval)
            grant = extra_steps(me, them, time.time(), s_low, s_high)
        before = (self._credit.remaining, self._credit.granted_this_episode)
        passed = decide(self.clock, slowest.clock, is_fastest, self._credit, grant, s_low)
        if (self._credit.remaining, self._credit.granted_this_episode) != before:
            credit = {
                "remaining": self._credit.remaining,
                "granted_this_episode": self._credit.granted_this_episode,
            }
            self.etcd.put(self.credit_key(), json.dumps(credit))
        return observed if passed else None

    def _mean_interval(self) -> float:
        return sum(self._intervals) / len(self._intervals) if self._intervals else 0.0

    def _wait_slowest(self, started: float) -> Passage:
        deadline = started + self.timeout
        while not may_start(self.clock, [self._slowest], self.spec.bound):
            self.counters.waits += 1
            self._handle(self._next(deadline, self._slowest_ranks))
        return Passage(self.clock, self._slowest, {}, time.monotonic() - started)

    def _slowest_ranks(self) -> list[int]:
        """Who is at the lowest level now (read only to name them in a timeout)."""
        keys, _ = self.etcd.get_prefix(self.order_prefix())
        levels = {kv.key: self._level_of(kv) for kv in keys}
        low = min(levels.values(), default=DONE)
        return sorted(rank_of(key) for key, level in levels.items() if level == low)

    def _wait_full(self, started: float) -> Passage:
        deadline = started + self.timeout
        while True:
            observed = self._decide_full()
            if observed is not None:
                slowest = min(observed.values(), default=None)
                return Passage(self.clock, slowest, observed, time.monotonic() - started)
            self.counters.waits += 1
            # Block until the view changes, then decide again.
            self._handle(self._next(deadline, lambda: sorted(self._unfinished())))

    def _wait_sampled(self, started: float) -> Passage:
        deadline = started + self.timeout
        drawn, self._next_sample = self._next_sample, None
        if drawn is None:  # the first step: nothing was read with a publish yet
            sample = draw_sample(self._rng, sorted(self.live), self.spec.sample)
            reads = [Get(self.clock_key(rank)) for rank in sample]
            result = self.etcd.transaction(reads) if reads else None
            drawn = _Sample(sample, result.reads if result else [], result.revision if result else 0)
        self.counters.reads += len(drawn.ranks)
        seen: dict[int, Clock] = {}

        def learn(rank: int, kv: KeyValue | None) -> None:
            if kv is None:
                self._peer_lost(rank, "its clock key is gone (its lease ended)")
            else:
                newer = Clock.parse(kv.value)
                old = seen.get(rank)
                # An event can be older than a re-read: a clock never goes back.
                if old is None or (newer.clock, newer.done) >= (old.clock, old.done):
                    seen[rank] = newer

        for rank, kv in zip(drawn.ranks, drawn.answers, strict=True):
            if rank in self.live:  # a loss seen since the read already took it out
                learn(rank, kv)

        def observed() -> dict[int, int]:
            return {r: c.clock for r, c in seen.items() if r in self.live and not c.done}

        def passage() -> Passage:
            seen_now = observed()
            slowest = min(seen_now.values(), default=None)
            return Passage(self.clock, slowest, seen_now, time.monotonic() - started)

        if may_start(self.clock, observed().values(), self.spec.bound):
            return passage()
        self.counters.waits += 1
        self._token += 1
        token = self._token
        watches = []
        try:
            # Clocks only grow: only the peers behind the bound can hold this worker up.
            # Their watches start "now" (a start revision in the past puts a watch in
            # etcd's unsynced group, whose events come up to 100 ms late) and are
            # created together; a key whose watch etcd registered after the read's
            # revision may have changed in between, so it is read again.
            behind = [r for r in observed() if seen[r].clock < self.clock - self.spec.bound]
            for rank in behind:
                watches.append(
                    self.etcd.watch(
                        self.clock_key(rank),
                        lambda events: self._inbox.put(("sample", token, events)),
                        0,
                        wait=False,
                    )
                )
            self.counters.watches += len(watches)
            late = [r for r, w in zip(behind, watches, strict=True) if w.created() > drawn.revision]
            if late:
                self.counters.rereads += len(late)
                again = self.etcd.transaction([Get(self.clock_key(r)) for r in late]).reads
                for rank, kv in zip(late, again, strict=True):
                    learn(rank, kv)
                if may_start(self.clock, observed().values(), self.spec.bound):
                    return passage()
            while True:
                item = self._next(deadline, lambda: sorted(observed()))
                if item[0] == "sample" and item[1] == token:
                    for event in item[2]:
                        rank = rank_of(event.key)
                        if event.kind == "put":
                            learn(rank, KeyValue(event.key, event.value, 0, event.revision, 0))
                        else:
                            self._peer_lost(rank, "its lease ended (the process died)")
                else:
                    self._handle(item)
                if may_start(self.clock, observed().values(), self.spec.bound):
                    return passage()
        finally:
            for watch in watches:
                watch.cancel()

    # -- events -----------------------------------------------------------

    def _next(self, deadline: float, blocking: Any) -> tuple[Any, ...]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RendezvousTimeout(f"steps (clock {self.clock})", self.timeout, blocking())
        try:
            return self._inbox.get(timeout=remaining)
        except queue.Empty:
            raise RendezvousTimeout(
                f"steps (clock {self.clock})", self.timeout, blocking()
            ) from None

    def _drain(self) -> None:
        """Apply whatever arrived since the last step (losses first of all)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _handle(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "session":
            raise SessionLost(f"this member's etcd lease is lost ({item[1]}) during the steps")
        if kind == "members":
            for event in item[1]:
                self._peer_lost(rank_of(event.key), loss_reason(member_state(event.prev_value)))
            if self._by_slowest:
                self._refresh_slowest()  # a lost slowest worker raises the minimum unannounced
        elif kind == "slowest":
            self._slowest = max([self._slowest, *(int(e.value) for e in item[1] if e.value)])
        elif kind == "view":
            for event in item[1]:
                rank = rank_of(event.key)
                if event.kind == "put":
                    self._view[rank] = Clock.parse(event.value)
                elif rank != self.rank:
                    self._peer_lost(rank, "its clock key vanished (its lease ended)")

    def _peer_lost(self, rank: int, reason: str) -> None:
        if rank == self.rank:
            raise SessionLost("this member's own key vanished during the steps")
        if rank not in self.live and rank in self.participants:
            return  # already left the set
        if self.on_loss == OnLoss.FAIL or rank not in self.participants:
            raise MemberLost(rank, f"steps (clock {self.clock})", reason)
        self.live.discard(rank)
        self._view.pop(rank, None)
        self.counters.lost.append(rank)
