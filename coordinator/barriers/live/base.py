"""What every live step barrier shares: the start barrier, the inbox, losses, publishing, stop.

A worker's clock is a key bound to its lease, under `<root><round>/` (`root`
is `<ns>/jobs/<job>/steps/` by default): `clocks/<rank>` holds
`{"clock", "t", "interval", "done"}`: completed steps, wall time of the last
push, the mean of recent step intervals (what DSSP predicts from), and whether
the worker has finished. Leased, so a dead worker's clock vanishes and the
others see it. This module puts it (ASP, DSSP); BSP/SSP and pBSP/pSSP publish
in their own transaction (`_write_clock`).

Watches never act on their own thread: their callbacks only put into the
inbox, and the worker's thread applies what arrived (`_drain`, `_apply_next`) before
and while it waits. So the state a decision reads changes only between
decisions, and no etcd request happens inside one: a method reads, decides
(the pure `policy.may_start` and `dssp.decide`, shared with the simulator),
then writes.

Only the `participants` step (all members by default; a parameter-server job's
trainers): the others publish no clock, and losing one of them always fails the
steps, since nothing can go on without it. A finished worker (`done`) no longer
constrains anyone: nothing it will do can change, so waiting for it would hang
(the early-finisher pitfall of seed 000). A lost peer (its lease ended) fails
the step with `MemberLost` naming it, or, with `OnLoss.CONTINUE`, leaves the
barrier set and the rest carry on.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from coordinator.barriers.live.records import Clock, Counters, Passage
from coordinator.barriers.policy import BarrierSpec, Method, OnLoss
from coordinator.etcd.errors import LeaseNotFound
from coordinator.etcd.values import json_object
from coordinator.etcd.watch import Watch, WatchEvent
from coordinator.keys import StepKeys, rank_of
from coordinator.rendezvous.errors import MemberLost, RendezvousTimeout, SessionLost
from coordinator.rendezvous.member import Member, loss_reason

Inboxed = tuple[Callable[[Any], None], Any]  # what to apply on the worker's thread, and to what


class LiveBarrier:
    """One worker's side of a step barrier; call `start`, then `wait_turn`/`complete` per step.

    `LiveBarrier(member, spec, ...)` makes the subclass that runs `spec.method`:
    each names the methods it runs in its class statement (`methods=`).
    """

    methods: ClassVar[tuple[Method, ...]] = ()
    _runs: ClassVar[dict[Method, type[LiveBarrier]]] = {}

    def __init_subclass__(cls, methods: tuple[Method, ...] = (), **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.methods = methods
        for method in methods:
            LiveBarrier._runs[method] = cls

    def __new__(cls, member: Member, spec: BarrierSpec, **options: Any) -> LiveBarrier:
        if cls is LiveBarrier:
            try:
                cls = LiveBarrier._runs[spec.method]
            except KeyError:
                raise ValueError(f"method: no live barrier runs {spec.method!r}") from None
        return super().__new__(cls)

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
        if spec.method not in self.methods:
            raise ValueError(f"method: {type(self).__name__} does not run {spec.method}")
        self.member = member
        self.etcd = member.etcd
        if member.rank is None:
            raise ValueError("the member must have joined (rendezvous) before a step barrier")
        self.rank: int = member.rank
        self.on_loss = on_loss
        self.timeout = member.timeout if timeout is None else timeout
        self.keys = StepKeys(root or member.keys.steps, member.round)
        self.clock = start_clock
        # The ranks that step (a parameter server's trainers); the others never publish a
        # clock, and losing one of them fails the steps whatever `on_loss` says.
        self.participants = frozenset(
            range(member.world_size) if participants is None else participants
        )
        if self.rank not in self.participants:
            raise ValueError(f"rank {self.rank} is not among the barrier's participants")
        self.live = set(self.participants) - {self.rank}  # peers still in the set
        self.counters = Counters()
        # Samples are drawn from a seed every member knows (the job's, or the round),
        # so a worker can tell which peers sampled it at a given clock.
        self._seed = seed if seed is not None else member.round
        self._start = (start_barrier, self.participants if start_among_participants else None)
        self._intervals: deque[float] = deque(maxlen=5)
        self._last_push = time.time()
        self._inbox: queue.Queue[Inboxed] = queue.Queue()
        self._watches: list[Watch] = []
        self._setup()

    # -- what a method adds -----------------------------------------------

    def _setup(self) -> None:
        """The method's own state, set once the shared state is."""

    def _watch_before_publish(self) -> None:
        """Watches that must exist before this worker's first clock is out."""

    def _after_start_barrier(self) -> None:
        """Reads and watches once everyone has published the start clock."""

    def _write_clock(self, value: str, done: bool, stepped: bool) -> int:
        """Publish this worker's clock; the revision. `stepped`: after a step, not at start."""
        return self.etcd.put(self.keys.clock(self.rank), value, self.member.lease_id)

    def _wait(self, started: float) -> Passage:
        """Block until the method lets this worker start step `clock + 1`."""
        raise NotImplementedError

    def _after_losses(self) -> None:
        """Called once the peers of a members event have left (or failed the steps)."""

    def _peer_left(self, rank: int) -> None:
        """`rank` has left the barrier set (`OnLoss.CONTINUE`)."""

    # -- lifecycle --------------------------------------------------------

    def start(self) -> None:
        """Publish the start clock, then the start barrier: everyone begins together."""
        self._watch_before_publish()
        revision = self._publish(done=False)
        # Any loss from here on is seen: the member's own barrier covers the time before.
        self._watch(
            self.member.keys.members, self._members_gone, revision + 1, prefix=True,
            only_deletes=True,
        )  # fmt: skip
        self.member.on_session_lost(lambda reason: self._inbox.put((self._session_lost, reason)))
        name, among = self._start
        self.member.barrier(name, ranks=among)
        self._after_start_barrier()

    def wait_turn(self) -> Passage:
        """Block until this worker may start step `clock + 1`, as the method says."""
        started = time.monotonic()
        self._drain()
        passage = self._wait(started)
        self.counters.checks += 1
        return passage

    def complete(self) -> None:
        """One more step done: publish the new clock (one request; PSP reads its next sample)."""
        self._count_step()
        self._publish(done=False, stepped=True)

    def finish(self) -> None:
        """Say this worker is done, so nobody waits for it, and stop watching."""
        self._publish(done=True)
        self.close()

    def close(self) -> None:
        for watch in self._watches:
            watch.cancel()
        self._watches.clear()

    def _count_step(self) -> float:
        """Step bookkeeping (clock, intervals); the wall time of this push."""
        now = time.time()
        self._intervals.append(now - self._last_push)
        self._last_push = now
        self.clock += 1
        return now

    def _mean_interval(self) -> float:
        return sum(self._intervals) / len(self._intervals) if self._intervals else 0.0

    def _publish(self, done: bool, stepped: bool = False) -> int:
        value = Clock(self.clock, self._last_push, self._mean_interval(), done).dump()
        try:
            return self._write_clock(value, done, stepped)
        except LeaseNotFound as exc:
            raise SessionLost("this member's etcd lease is gone (etcd refused its clock)") from exc

    # -- events -----------------------------------------------------------

    def _watch(
        self, key: str, apply: Callable[[list[WatchEvent]], None], revision: int, **options: Any
    ) -> None:
        """Watch `key` from `revision`; `apply` runs on the worker's thread (see the module)."""
        deliver = self._inbox.put
        self._watches.append(
            self.etcd.watch(key, lambda events: deliver((apply, events)), revision, **options)
        )

    def _apply_next(self, deadline: float, blocking: Callable[[], list[int]]) -> None:
        """Apply the next arrival, or raise `RendezvousTimeout` naming `blocking()` at the
        deadline."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RendezvousTimeout(f"steps (clock {self.clock})", self.timeout, blocking())
        try:
            apply, payload = self._inbox.get(timeout=remaining)
        except queue.Empty:
            raise RendezvousTimeout(
                f"steps (clock {self.clock})", self.timeout, blocking()
            ) from None
        apply(payload)

    def _drain(self) -> None:
        """Apply whatever arrived since the last step (losses first of all)."""
        while True:
            try:
                apply, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            apply(payload)

    def _session_lost(self, reason: str) -> None:
        raise SessionLost(f"this member's etcd lease is lost ({reason}) during the steps")

    def _members_gone(self, events: list[WatchEvent]) -> None:
        for event in events:
            self._peer_lost(rank_of(event.key), loss_reason(json_object(event.prev_value)))
        self._after_losses()

    def _peer_lost(self, rank: int, reason: str) -> None:
        if rank == self.rank:
            raise SessionLost("this member's own key vanished during the steps")
        if rank not in self.live and rank in self.participants:
            return  # already left the set
        if self.on_loss == OnLoss.FAIL or rank not in self.participants:
            raise MemberLost(rank, f"steps (clock {self.clock})", reason)
        self.live.discard(rank)
        self.counters.lost.append(rank)
        self._peer_left(rank)
