"""A program's step barrier: the handle `Context.steps()` returns, and the checks of
its stop and stepping ranks (each error names the argument; the barrier's own are
`barriers.arguments`'), apart from the context so that the loop's contract reads on
its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from coordinator.barriers.live import LiveBarrier, OnLoss, Passage
from coordinator.barriers.policy import BarrierSpec
from coordinator.rendezvous.attached import AttachedMember


def check_ranks(ranks: Iterable[int] | None, rank: int, world: int) -> frozenset[int]:
    """The stepping ranks, or a ValueError naming `ranks`."""
    if ranks is None:
        return frozenset(range(world))
    chosen = list(ranks)
    if not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world for r in chosen):
        raise ValueError(f"ranks must be ranks of this job (0..{world - 1}), got {chosen!r}")
    if rank not in chosen:
        raise ValueError(f"ranks={chosen!r} leaves out this program's own rank {rank}")
    return frozenset(chosen)


def check_stop(num_steps: int | None, last_step: int | None, start: int) -> int | None:
    """The clock to stop at (None: until `finish()`), or a ValueError naming the argument."""
    if num_steps is not None and last_step is not None:
        raise ValueError("give at most one of num_steps and last_step")
    for name, value in (("num_steps", num_steps), ("last_step", last_step), ("start", start)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if last_step is not None:
        return last_step
    return None if num_steps is None else start + num_steps


class Steps:
    """A step barrier for the caller's loop: `wait(c)` before a step, `done(c + 1)` after.

    Iterating does both: `for clock in ctx.steps("ssp", staleness=2, num_steps=100):`
    yields each clock (steps completed) the method lets this program start from.
    Every program first passes a start barrier (on the first `wait`); a program
    that reaches its target says so (`finish`), and no longer holds anyone back.
    """

    def __init__(
        self,
        member: AttachedMember,
        spec: BarrierSpec,
        on_loss: OnLoss,
        target: int | None,
        start: int,
        seed: int | None,
        timeout: float | None,
        root: str,
        ranks: frozenset[int],
    ) -> None:
        self.spec, self.target, self.on_loss = spec, target, on_loss
        self._member = member
        self._args = (spec, on_loss, start, seed, timeout, root, ranks)
        self._barrier: LiveBarrier | None = None
        self._clock = start
        self._finished = False

    @property
    def clock(self) -> int:
        """Steps completed (as published)."""
        return self._clock

    @property
    def lost(self) -> list[int]:
        """Ranks lost and carried on without (`on_loss="continue"`)."""
        return list(self._barrier.counters.lost) if self._barrier else []

    def _started(self) -> LiveBarrier:
        if self._barrier is None:
            spec, on_loss, start, seed, timeout, root, ranks = self._args
            if on_loss == OnLoss.CONTINUE:
                self._member.carry_on_without_lost()
            self._barrier = LiveBarrier(
                self._member,
                spec,
                on_loss=on_loss,
                start_clock=start,
                seed=seed,
                timeout=timeout,
                root=root,
                participants=ranks,
                start_barrier=f"steps-{root.split('/')[-2]}-start",  # one per Steps
                start_among_participants=True,
            )
            self._barrier.start()
        return self._barrier

    def wait(self, clock: int) -> Passage:
        """Block until the method lets this program start step `clock + 1`, having
        completed `clock` steps. Raises `MemberLost` (a peer lost, `on_loss="fail"`),
        `RendezvousTimeout`, or `SessionLost` (this program's member is gone).
        Returns what the decision saw (informational: the clocks it relied on)."""
        if clock != self._clock:
            raise ValueError(f"wait({clock}): this program has completed {self._clock} steps")
        if self._finished:
            raise ValueError("these steps are finished")
        return self._started().wait_turn()

    def done(self, clock: int) -> None:
        """Publish that `clock` steps are complete (one more than before); at the target,
        also `finish()`."""
        if clock != self._clock + 1:
            raise ValueError(f"done({clock}): the next clock is {self._clock + 1}")
        barrier = self._started()
        barrier.complete()
        self._clock = barrier.clock
        if self.target is not None and self._clock >= self.target:
            self.finish()

    def finish(self) -> None:
        """Say this program steps no more, so nobody waits for it."""
        if self._finished:
            return
        self._finished = True
        self._started().finish()

    def close(self) -> None:
        if self._barrier is not None:
            self._barrier.close()

    def __iter__(self) -> Iterator[int]:
        if self.target is None:
            raise ValueError("iterating needs num_steps or last_step")
        try:
            while self._clock < self.target:
                clock = self._clock
                self.wait(clock)
                yield clock
                self.done(clock + 1)
            self.finish()
        finally:
            self.close()

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.finish()
        self.close()
