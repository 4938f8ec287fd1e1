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
- `<round>/at/<rank>` (PSP): the clock again, fixed-width so that another
  worker's transaction can compare it; `DONE` once the worker finished or,
  with `OnLoss.CONTINUE`, was lost (then put by whoever saw the loss). It is
  what samples read.
- `<round>/mail/<to>/<from>` (PSP): the wake-up of `to`, put by `from`: its new
  clock, after which all of `to`'s sample is where `to` needs it (or `DONE`:
  `from` finished). Leased by `from`.
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
- pBSP and pSSP draw one sample of beta peers per step (`PER_STEP`), and read
  those beta clocks in the transaction that publishes the step. A worker that
  must wait is woken by the last of its sample to get there: every publishing
  transaction also puts a wake-up in the mailbox of each worker that sampled
  this one, on condition (checked by etcd, in the same transaction) that this
  worker was the last one missing (see `_publish_sampled`). Samples are drawn
  from a seed every member knows, so a worker knows who sampled it; each
  watches its mailbox for the whole run. So a step is one request, a check
  reads beta keys and creates no watch, and a wait costs one notification,
  whatever P is.
- ASP reads nothing, and publishes its clock at most every
  `ASP_PUBLISH_SECONDS` (and when it finishes): nobody waits on it, it only
  shows progress, and a request per step is a tenth of a small model's step.

Only the `participants` step (all members by default; a parameter-server job's
trainers): the others publish no clock, and losing one of them always fails the
steps, since nothing can go on without it.

A finished worker (`done`) no longer constrains anyone: nothing it will do can
change, so waiting for it would hang (the early-finisher pitfall of seed 000).
A lost peer (its lease ended) fails the step with `MemberLost` naming it, or,
with `OnLoss.CONTINUE`, leaves the barrier set and the rest carry on.
"""

from __future__ import annotations

import bisect
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
    TxnOp,
    ValueIs,
    Watch,
    When,
    prefix_end,
)
from coordinator.rendezvous.errors import MemberLost, RendezvousTimeout, SessionLost
from coordinator.rendezvous.member import Member, loss_reason, member_state, rank_of

DONE = 10**12 - 1  # the order level of a finished worker: above every clock
LEVEL_DIGITS = 12
MAX_TXN_OPS = 128  # etcd's default cap: a transaction's operations plus its widest nested one
ASP_PUBLISH_SECONDS = 0.2


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
    # rank -> clock, the unfinished peers read (PSP sample, DSSP view); PSP passes a peer
    # that a wake-up vouched for, but not read since, as `clock - s` (it is at least there)
    observed: dict[int, int]
    waited: float  # seconds spent waiting


class _StepRandom(random.Random):
    """The generator of one sample: the same in every member, and cheap to create.

    A pBSP/pSSP worker needs every peer's sample at each step (to know who may
    wait for it), so P samples a step: seeding a Mersenne Twister costs about
    10 µs, and `Random.sample` about 4. Here a SplitMix64 stream (Steele, Lea
    and Flood) and a partial Fisher-Yates shuffle (`_positions`): about 2 µs.
    """

    def seed(self, a: Any = None, version: int = 2) -> None:
        self._state = int(a or 0) & _MASK64

    def getrandbits(self, k: int) -> int:
        bits, have = 0, 0
        while have < k:
            self._state, value = _splitmix(self._state)
            bits, have = (bits << 64) | value, have + 64
        return bits >> (have - k)

    def random(self) -> float:
        return self.getrandbits(53) * 2.0**-53

    def sample(self, population: Any, k: int, *, counts: Any = None) -> list[Any]:
        """`k` of `population`, uniformly without replacement (`counts` is not supported)."""
        if counts is not None or not 0 <= k <= len(population):
            raise ValueError("sample larger than population, or counts given")
        picked = [population[i] for i in _positions(self._state, len(population), k)]
        self._state = (self._state + k * 0x9E3779B97F4A7C15) & _MASK64
        return picked


_MASK64 = (1 << 64) - 1


def _positions(state: int, n: int, k: int) -> list[int]:
    """`k` of `range(n)` without replacement, from a SplitMix64 stream at `state`."""
    moved: dict[int, int] = {}
    picked = []
    for i in range(k):  # a partial Fisher-Yates shuffle: swap a later position into i
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        j = i + (z ^ (z >> 31)) % (n - i)  # the modulo's bias is below n / 2**64
        picked.append(moved.get(j, j))
        moved[j] = moved.get(i, i)
    return picked


def _splitmix(state: int) -> tuple[int, int]:
    """SplitMix64: the next state and its 64-bit output."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


@dataclass(frozen=True)
class _Sample:
    """One check's sample (pBSP/pSSP) and its clock keys as read (None: the key is gone)."""

    ranks: list[int]
    answers: list[KeyValue | None]


@dataclass
class _Counters:
    checks: int = 0
    reads: int = 0
    watches: int = 0
    waits: int = 0
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
        root: str | None = None,
        start_barrier: str = "steps-start",
        start_among_participants: bool = False,
    ) -> None:
        """`root`: where the keys go (default `<job>/steps/`; a program's own step barriers
        each get one of their own). `start_barrier`: the member barrier everyone passes
        before the first step: every member of the job (a parameter-server job's servers
        pass it too), or, with `start_among_participants`, only the participants."""
        self.spec = spec.validate()
        self.member = member
        self.etcd = member.etcd
        if member.rank is None:
            raise ValueError("the member must have joined (rendezvous) before a step barrier")
        self.rank: int = member.rank
        self.on_loss = on_loss
        self.timeout = member.timeout if timeout is None else timeout
        self.root = root or member.keys.job + "steps/"
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
        # Samples are drawn from a seed every member knows (the job's, or the round),
        # so a worker can tell which peers sampled it at a given clock.
        self._seed = seed if seed is not None else member.round
        self._ordered = sorted(self.participants)
        self._start = (start_barrier, self.participants if start_among_participants else None)
        self._intervals: deque[float] = deque(maxlen=5)
        self._last_push = time.time()
        self._asp_published = 0.0
        self._view: dict[int, Clock] = {}  # every peer's clock (full-view methods)
        self._inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._watches: list[Watch] = []
        self._credit = Credit()
        self._by_slowest = spec.method in (Method.BSP, Method.SSP)
        self._full_view = spec.method == Method.DSSP
        self._level: int | None = None  # this worker's order level (BSP/SSP)
        self._slowest = -1  # the highest job-wide slowest clock known (BSP/SSP)
        self._next_sample: _Sample | None = None  # pBSP/pSSP: read with the last publish
        self._mail: dict[int, int] = {}  # pBSP/pSSP: the highest clock each peer mailed
        self._vouched = -1  # pBSP/pSSP: the last clock whose whole sample a wake-up vouched for
        self._stale = False  # pBSP/pSSP: a peer finished or was lost: a wake-up may never come
        self._left: set[int] = set()  # pBSP/pSSP: lost peers whose `at` key is not DONE yet

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

    def at_key(self, rank: int) -> str:
        """pBSP/pSSP: a worker's clock, fixed-width, so a transaction can compare it."""
        return f"{self.round_prefix}at/{rank:06d}"

    def mailbox(self, rank: int) -> str:
        return f"{self.round_prefix}mail/{rank:06d}/"

    # -- samples (pBSP/pSSP) ------------------------------------------------

    def sample_of(self, rank: int, clock: int) -> list[int]:
        """The peers `rank` observes before the step after `clock`: drawn once per step.

        From all the other participants (a lost one is then not observed), with a
        generator seeded by (seed, rank, clock): every member draws the same.
        """
        rng = _StepRandom(self._sample_seed(rank, clock))
        # Positions among the others (no list of them: P draws a step), then ranks.
        at = bisect.bisect_left(self._ordered, rank)
        drawn = draw_sample(rng, range(len(self._ordered) - 1), self.spec.sample)
        return [self._ordered[i + (i >= at)] for i in drawn]

    def _sample_seed(self, rank: int, clock: int) -> int:
        return (self._seed * 1_000_003 + rank) * 1_000_000_007 + clock

    def samplers(self, clock: int) -> dict[int, list[int]]:
        """The peers whose sample before the step after `clock` holds this worker, and
        those samples.

        P draws a step: the price of knowing, without asking etcd, whom to wake.
        When the sample is a strict part of the others, `draw_sample` draws it with
        `_StepRandom.sample`, so the positions alone say whether it holds this
        worker (about 1.5 µs a peer, against 4 for drawing the sample).
        """
        others, beta = len(self._ordered) - 1, self.spec.sample
        me = bisect.bisect_left(self._ordered, self.rank)
        found = {}
        for index, rank in enumerate(self._ordered):
            if rank == self.rank:
                continue
            if 0 < beta < others:
                mine = me - (index < me)  # this worker's position among the peers of `rank`
                if mine not in _positions(self._sample_seed(rank, clock), others, beta):
                    continue
            sample = self.sample_of(rank, clock)
            if self.rank in sample:
                found[rank] = sample
        return found

    # -- lifecycle --------------------------------------------------------

    def start(self) -> None:
        """Publish the start clock, then the start barrier: everyone begins together."""
        if self.spec.sampled:
            # Before the first publish: no mail for this worker can precede it.
            self._watches.append(
                self.etcd.watch(
                    self.mailbox(self.rank), lambda events: self._inbox.put(("mail", events)), 0,
                    prefix=True, prev_kv=False,
                )
            )  # fmt: skip
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
        name, among = self._start
        self.member.barrier(name, ranks=among)
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
                    revision + 1, prev_kv=False,
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
                    prefix=True, prev_kv=False,
                )
            )  # fmt: skip

    def complete(self) -> None:
        """One more step done: publish the new clock (one request; PSP reads its next sample)."""
        now = time.time()
        self._intervals.append(now - self._last_push)
        self._last_push = now
        self.clock += 1
        if self.spec.method == Method.ASP:
            if now - self._asp_published < ASP_PUBLISH_SECONDS:
                return
            self._asp_published = now
        self._publish(done=False, stepped=True)

    def finish(self) -> None:
        """Say this worker is done, so nobody waits for it, and stop watching."""
        self._publish(done=True)
        self.close()

    def close(self) -> None:
        for watch in self._watches:
            watch.cancel()
        self._watches.clear()

    def _publish(self, done: bool, stepped: bool = False) -> int:
        value = Clock(self.clock, self._last_push, self._mean_interval(), done).dump()
        lease = self.member.lease_id
        try:
            if self._by_slowest:
                return self._move_up(value, done)
            if self.spec.sampled:
                return self._publish_sampled(value, done, stepped)
            return self.etcd.put(self.clock_key(self.rank), value, lease)
        except LeaseNotFound as exc:
            raise SessionLost("this member's etcd lease is gone (etcd refused its clock)") from exc

    def _publish_sampled(self, clock: str, done: bool, stepped: bool) -> int:
        """pBSP/pSSP: publish, wake who waits for this clock, read the next sample: one request.

        A worker at clock `c` waits until every peer of its sample is at `c - s`.
        So a new clock `k` (`stepped`) may be the last one missing for the workers
        that sampled this one before the step after `c = k + s`: for each, a nested
        transaction puts a wake-up in its mailbox if it is at `c` (it published `c`
        and read its sample in the same transaction, so it waits) and the rest of
        its sample is at `k` already. Transactions are ordered, so of the peers a
        worker waits for, exactly the last one to publish sees the others there and
        wakes it; a peer that publishes before the worker gets to `c` is seen by
        the worker's own read. A finished worker wakes every peer beyond `k + s`,
        which may be waiting for it; the start clock wakes nobody (the start
        barrier follows it).
        """
        lease = self.member.lease_id
        me, at = self.clock_key(self.rank), self.at_key(self.rank)
        bound = self.spec.bound or 0
        now = _fixed(DONE if done else self.clock)
        ops: list[TxnOp] = [Put(me, clock, lease), Put(at, now, lease), *self._mark_left()]
        mail: list[When] = []
        ready, finished = _fixed(self.clock - 1), _fixed(DONE)
        if done:
            # Anyone beyond k + s may be waiting for this worker: wake them all.
            for rank in self._ordered:
                if rank != self.rank:
                    beyond = ValueIs(self.at_key(rank), ">", _fixed(self.clock + bound))
                    waiting = ValueIs(self.at_key(rank), "<", finished)
                    mail.append(When((beyond, waiting), (self._wake_up(rank, now),)))
        elif stepped:
            there = _fixed(self.clock + bound)
            for rank, sample in self.samplers(self.clock + bound).items():
                others = [ValueIs(self.at_key(r), ">", ready) for r in sample if r != self.rank]
                waits = ValueIs(self.at_key(rank), "=", there)
                mail.append(When((waits, *others), (self._wake_up(rank, now),)))
        sample = self.sample_of(self.rank, self.clock) if stepped else []
        reads = [Get(self.at_key(r)) for r in sample]
        # Wake-ups may follow the clock in later transactions (etcd caps a transaction's
        # size): a peer that reads in between already sees the clock.
        room = max(1, MAX_TXN_OPS - max((len(m.conditions) for m in mail), default=0))
        first = max(0, room - len(ops) - len(reads))
        result = self.etcd.transaction([*ops, *mail[:first], *reads])
        for start in range(first, len(mail), room):
            self.etcd.transaction(mail[start : start + room])
        if stepped:
            self._next_sample = _Sample(sample, result.reads)
        return result.revision

    def _wake_up(self, rank: int, clock: str) -> Put:
        return Put(f"{self.mailbox(rank)}{self.rank:06d}", clock, self.member.lease_id)

    def _mark_left(self) -> list[TxnOp]:
        """Puts that mark the peers lost since the last ones (`OnLoss.CONTINUE`) finished.

        A lost worker's `at` key vanishes with its lease, and a missing key fails
        every wake-up condition that names it: marked `DONE` it satisfies them, as
        a finished worker does. Not leased: the mark must outlive whoever put it.
        """
        marks: list[TxnOp] = [Put(self.at_key(r), _fixed(DONE)) for r in sorted(self._left)]
        self._left.clear()
        return marks

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
        """pBSP/pSSP: the sample was read with the last publish; wait for a wake-up, if at all.

        A peer vouched for by a wake-up is known to be at `clock - s` at least; it
        is passed on as that.
        """
        deadline = started + self.timeout
        drawn, self._next_sample = self._next_sample, None
        if drawn is None:  # the first check after start: nothing was read with a publish
            ranks = self.sample_of(self.rank, self.clock)
            reads = [Get(self.at_key(r)) for r in ranks]
            drawn = _Sample(ranks, self.etcd.transaction(reads).reads if reads else [])
        self.counters.reads += len(drawn.ranks)
        seen: dict[int, int] = {}  # rank -> clock, DONE once finished

        def learn(answers: list[KeyValue | None]) -> None:
            for rank, kv in zip(drawn.ranks, answers, strict=True):
                if rank not in self.live:
                    continue  # lost (with on_loss=continue): not observed
                if kv is None:
                    self._peer_lost(rank, "its clock key is gone (its lease ended)")
                else:
                    seen[rank] = max(seen.get(rank, -1), _clock_at(kv.value))

        def passed() -> bool:
            vouched = self.clock - (self.spec.bound or 0) if self._vouched == self.clock else -1
            for rank in seen:
                seen[rank] = max(seen[rank], self._mail.get(rank, -1), vouched)
            return may_start(self.clock, observed().values(), self.spec.bound)

        def observed() -> dict[int, int]:
            return {r: c for r, c in seen.items() if r in self.live and c != DONE}

        learn(drawn.answers)
        if not passed():
            self.counters.waits += 1
            while not passed():
                if self._stale:
                    # A peer finished or was lost, so the wake-up may never come: read again
                    # (and mark the lost ones finished, for everyone's conditions).
                    self._stale = False
                    again = [Get(self.at_key(r)) for r in drawn.ranks]
                    self.counters.reads += len(again)
                    learn(self.etcd.transaction([*self._mark_left(), *again]).reads)
                    continue
                self._handle(self._next(deadline, lambda: sorted(observed())))
        self._stale = False
        seen_now = observed()
        slowest = min(seen_now.values(), default=None)
        return Passage(self.clock, slowest, seen_now, time.monotonic() - started)

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
        elif kind == "mail":
            for event in item[1]:
                if event.kind == "put":  # a delete: the sender left (the members watch says)
                    rank, clock = rank_of(event.key), int(event.value)
                    self._mail[rank] = max(clock, self._mail.get(rank, -1))
                    if clock == DONE:
                        self._stale = True  # it wakes all who may wait for it, vouching for none
                    else:
                        self._vouched = max(self._vouched, clock + (self.spec.bound or 0))
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
        if self.spec.sampled:
            self._left.add(rank)
            self._stale = True


def _fixed(clock: int) -> str:
    """A clock as a fixed-width string: etcd compares values as bytes."""
    return f"{clock:0{LEVEL_DIGITS}d}"


def _clock_at(value: bytes) -> int:
    """A worker's clock from its `at` value: DONE once it finished (or was lost)."""
    return int(value)
