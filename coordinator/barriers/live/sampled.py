"""pBSP and pSSP on etcd: each check reads a sample of beta peers; the last one wakes it.

Keys, under `<root><round>/`, besides `clocks/<rank>`:

- `at/<rank>`: the clock again, fixed-width so that another worker's
  transaction can compare it; `DONE` once the worker finished or, with
  `OnLoss.CONTINUE`, was lost (then put by whoever saw the loss). It is what
  samples read.
- `mail/<to>/<from>`: the wake-up of `to`, put by `from`: its new clock, after
  which all of `to`'s sample is where `to` needs it (or `DONE`: `from`
  finished). Leased by `from`.

A worker draws one sample of beta peers per step (`PER_STEP`), and reads those
beta clocks in the transaction that publishes the step. A worker that must
wait is woken by the last of its sample to get there: every publishing
transaction also puts a wake-up in the mailbox of each worker that sampled this
one, on condition (checked by etcd, in the same transaction) that this worker
was the last one missing (see `_write_clock`). Samples are drawn from a seed
every member knows, so a worker knows who sampled it; each watches its mailbox
for the whole run. So a step is one request, a check reads beta keys and
creates no watch, and a wait costs one notification, whatever P is.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from coordinator.barriers.live.base import LiveBarrier
from coordinator.barriers.live.records import DONE, Passage, fixed
from coordinator.barriers.live.sample_stream import StepRandom, positions
from coordinator.barriers.policy import Method, draw_sample, may_start
from coordinator.etcd.txn import Get, KeyValue, Put, TxnOp, ValueIs, When
from coordinator.etcd.watch import WatchEvent
from coordinator.keys import rank_of

MAX_TXN_OPS = 128  # etcd's default cap: a transaction's operations plus its widest nested one


@dataclass(frozen=True)
class _Sample:
    """One check's sample and its `at` keys as read (None: the key is gone)."""

    ranks: list[int]
    answers: list[KeyValue | None]


class SampledBarrier(LiveBarrier, methods=(Method.PBSP, Method.PSSP)):
    """pBSP/pSSP: wait until every peer of this step's sample is within the staleness."""

    def _setup(self) -> None:
        self._ordered = sorted(self.participants)
        self._next_sample: _Sample | None = None  # read with the last publish
        self._mail: dict[int, int] = {}  # the highest clock each peer mailed
        self._vouched = -1  # the last clock whose whole sample a wake-up vouched for
        self._stale = False  # a peer finished or was lost: a wake-up may never come
        self._left: set[int] = set()  # lost peers whose `at` key is not DONE yet

    # -- samples ----------------------------------------------------------

    def sample_of(self, rank: int, clock: int) -> list[int]:
        """The peers `rank` observes before the step after `clock`: drawn once per step.

        From all the other participants (a lost one is then not observed), with a
        generator seeded by (seed, rank, clock): every member draws the same.
        """
        rng = StepRandom(self._sample_seed(rank, clock))
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
        `StepRandom.sample`, so the positions alone say whether it holds this
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
                if mine not in positions(self._sample_seed(rank, clock), others, beta):
                    continue
            sample = self.sample_of(rank, clock)
            if self.rank in sample:
                found[rank] = sample
        return found

    # -- publishing -------------------------------------------------------

    def _watch_before_publish(self) -> None:
        # Before the first publish: no mail for this worker can precede it.
        self._watch(self.keys.mailbox(self.rank), self._mail_arrived, 0, prefix=True, prev_kv=False)

    def _write_clock(self, value: str, done: bool, stepped: bool) -> int:
        """Publish, wake who waits for this clock, read the next sample: one request.

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
        me, at = self.keys.clock(self.rank), self.keys.at(self.rank)
        bound = self.spec.bound or 0
        now = fixed(DONE if done else self.clock)
        ops: list[TxnOp] = [Put(me, value, lease), Put(at, now, lease), *self._mark_left()]
        mail: list[When] = []
        ready, finished = fixed(self.clock - 1), fixed(DONE)
        if done:
            # Anyone beyond k + s may be waiting for this worker: wake them all.
            for rank in self._ordered:
                if rank != self.rank:
                    beyond = ValueIs(self.keys.at(rank), ">", fixed(self.clock + bound))
                    waiting = ValueIs(self.keys.at(rank), "<", finished)
                    mail.append(When((beyond, waiting), (self._wake_up(rank, now),)))
        elif stepped:
            there = fixed(self.clock + bound)
            for rank, sample in self.samplers(self.clock + bound).items():
                others = [ValueIs(self.keys.at(r), ">", ready) for r in sample if r != self.rank]
                waits = ValueIs(self.keys.at(rank), "=", there)
                mail.append(When((waits, *others), (self._wake_up(rank, now),)))
        sample = self.sample_of(self.rank, self.clock) if stepped else []
        reads = [Get(self.keys.at(r)) for r in sample]
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
        return Put(self.keys.mail(rank, self.rank), clock, self.member.lease_id)

    def _mark_left(self) -> list[TxnOp]:
        """Puts that mark the peers lost since the last ones (`OnLoss.CONTINUE`) finished.

        A lost worker's `at` key vanishes with its lease, and a missing key fails
        every wake-up condition that names it: marked `DONE` it satisfies them, as
        a finished worker does. Not leased: the mark must outlive whoever put it.
        """
        marks: list[TxnOp] = [Put(self.keys.at(r), fixed(DONE)) for r in sorted(self._left)]
        self._left.clear()
        return marks

    # -- the decision -----------------------------------------------------

    def _wait(self, started: float) -> Passage:
        """The sample was read with the last publish; wait for a wake-up, if at all.

        A peer vouched for by a wake-up is known to be at `clock - s` at least; it
        is passed on as that. When a peer finished or was lost the wake-up may
        never come: the sample is read again (marking the lost ones finished, for
        everyone's conditions) and the decision made anew.
        """
        deadline = started + self.timeout
        drawn, self._next_sample = self._next_sample, None
        if drawn is None:  # the first check after start: nothing was read with a publish
            ranks = self.sample_of(self.rank, self.clock)
            reads = [Get(self.keys.at(r)) for r in ranks]
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
                    seen[rank] = max(seen.get(rank, -1), int(kv.value))

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
                    self._stale = False
                    again = [Get(self.keys.at(r)) for r in drawn.ranks]
                    self.counters.reads += len(again)
                    learn(self.etcd.transaction([*self._mark_left(), *again]).reads)
                    continue
                self._apply_next(deadline, lambda: sorted(observed()))
        self._stale = False
        seen_now = observed()
        slowest = min(seen_now.values(), default=None)
        return Passage(self.clock, slowest, seen_now, time.monotonic() - started)

    # -- events -----------------------------------------------------------

    def _mail_arrived(self, events: list[WatchEvent]) -> None:
        for event in events:
            if event.kind == "put":  # a delete: the sender left (the members watch says)
                rank, clock = rank_of(event.key), int(event.value)
                self._mail[rank] = max(clock, self._mail.get(rank, -1))
                if clock == DONE:
                    self._stale = True  # it wakes all who may wait for it, vouching for none
                else:
                    self._vouched = max(self._vouched, clock + (self.spec.bound or 0))

    def _peer_left(self, rank: int) -> None:
        self._left.add(rank)
        self._stale = True
