"""Discrete-event simulation of P virtual workers under one barrier method.

Semantics (documented choices, see docs/barriers.md):

- All workers start step 1 at t = 0 (a start barrier). A step's duration comes
  from the delay model through the worker's *own* RNG stream, so step k of
  worker w lasts the same under every method and every sampling choice
  (common random numbers); sampling uses one separate stream. Hence beta = 0
  reproduces ASP and beta >= the population reproduces SSP/BSP bit for bit.
- When a worker completes a step at time t (only if t <= the duration) its
  clock goes up by one, then it asks the decision code whether it may start
  the next step; if not it waits. Waiting workers are re-checked after every
  completion (the PSP authors' Ninox behaviour). Methods without sampling are
  deterministic in the clocks, so only waiting workers whose answer can change
  (those the slowest clock has just released) are re-checked: same result,
  O(log P) per event instead of O(P). Per-check sampling re-checks by clock
  group with the same distribution (see `strategies._per_check`).
- Events are kept in a calendar of time slots (`agenda`), popped in
  (time, worker) order; delays are drawn a few steps ahead per worker from its
  own stream (`delays.sampler`): the same numbers, in the same order.
- BSP/SSP ask `may_start(clock, (slowest,), s)`: the test over all clocks is
  the test over their minimum, which the engine keeps incrementally.
- pBSP/pSSP with `SampleTiming.PER_CHECK` (the reference) draw a fresh sample
  at every check from *all* P workers, the worker itself included (as Ninox);
  beta >= P then observes everyone. With `PER_STEP` (the live barrier) one
  sample of the *other* workers is drawn when the worker completes a step and
  is kept for the whole wait, re-checked whenever a sampled peer completes a
  step (a watch); beta >= P - 1 observes everyone.
- DSSP: `dssp.decide` with `dssp.extra_steps` from push times; a worker's
  interval is the mean of its last `DSSP_WINDOW` step durations (compute time,
  excluding waits: what its next step will take once it starts). The slowest
  worker passed to the controller is the one, among those with the minimum
  clock, whose predicted push is latest: the slowest clock only rises then.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.barriers.policy import BarrierSpec, Method, SampleTiming
from coordinator.simulator.agenda import agenda
from coordinator.simulator.delays import DelayModel, ShiftedExponential, sampler
from coordinator.simulator.strategies import Workers, strategy

DSSP_WINDOW = 3

Progress = Callable[[float], None]


@dataclass(frozen=True)
class Hooks:
    """Optional callbacks from the main loop, for a layer that does work in virtual time
    (`coordinator.simulator.training`); the barrier decisions stay the strategies'.

    `started(worker, t)` runs when a worker starts a step (all at t = 0 first);
    `completed(worker, t)` when it completes one, before the decision code sees the
    completion (so a worker released by it starts after what the completion did);
    `stop()` after each completion: True ends the run at that completion's time.
    """

    started: Callable[[int, float], None] | None = None
    completed: Callable[[int, float], None] | None = None
    stop: Callable[[], bool] | None = None


@dataclass
class Result:
    """Per-worker outcome of one run; lists are indexed by worker id."""

    spec: BarrierSpec
    timing: SampleTiming
    workers: int
    seconds: float
    seed: int
    final_step: list[int]
    wait_seconds: list[float]
    max_gap: list[int]  # largest (own clock - slowest clock) right after its completions
    events: int
    checks: int

    @property
    def largest_gap(self) -> int:
        """Max over the run of (fastest clock - slowest clock)."""
        return max(self.max_gap, default=0)

    @property
    def mean_step(self) -> float:
        return sum(self.final_step) / self.workers

    @property
    def mean_wait(self) -> float:
        return sum(self.wait_seconds) / self.workers

    @property
    def label(self) -> str:
        if self.spec.sampled:
            return f"{self.spec} {self.timing.value}"
        return str(self.spec)


def simulate(
    spec: BarrierSpec,
    workers: int,
    seconds: float,
    delay: DelayModel | None = None,
    seed: int = 0,
    timing: SampleTiming = SampleTiming.PER_CHECK,
    progress: Progress | None = None,
    exact_checks: bool = False,
    hooks: Hooks | None = None,
) -> Result:
    """Run `workers` virtual workers for `seconds` simulated seconds under `spec`.

    `exact_checks` makes per-check sampling draw every check's sample through
    the decision code instead of an equivalent probability (O(waiting) per step).
    `hooks` (optional) are called from the loop: see `Hooks`; a `stop` ends the run
    at that completion's time (`Result.seconds`).
    """
    spec.validate()
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not seconds >= 0:
        raise ValueError(f"seconds must be >= 0, got {seconds}")
    delay = delay or ShiftedExponential()
    n = workers
    rngs = [random.Random(f"{seed}:delay:{w}") for w in range(n)]
    sample_rng = random.Random(f"{seed}:sample")
    draw = sampler(delay, rngs)

    clock = [0] * n
    counts = [n]  # counts[c]: workers whose clock is c
    lead = [0] * n
    waiting = [False] * n
    wait_since = [0.0] * n
    wait_total = [0.0] * n
    started = [0.0] * n
    keep_durations = spec.method == Method.DSSP
    # a worker's last DSSP_WINDOW step durations (DSSP only)
    durations = [deque(maxlen=DSSP_WINDOW) for _ in range(n)] if keep_durations else []
    push, pop = agenda([draw(w, 1) for w in range(n)])
    stats = {"checks": 0}
    slow = {"min": 0, "max": 0}
    hooks = hooks or Hooks()
    on_started, on_completed, should_stop = hooks.started, hooks.completed, hooks.stop
    if on_started is not None:
        for w in range(n):
            on_started(w, 0.0)

    def start(v: int, t: float) -> None:
        if waiting[v]:
            waiting[v] = False
            wait_total[v] += t - wait_since[v]
        if keep_durations:
            started[v] = t
        if on_started is not None:
            on_started(v, t)
        push(t + draw(v, clock[v] + 1), v)

    def wait(v: int, t: float) -> None:
        waiting[v] = True
        wait_since[v] = t

    on_complete = strategy(
        spec,
        timing,
        Workers(n, clock, start, wait, stats, slow),
        exact_checks,
        sample_rng,
        durations,
    )

    events = 0
    min_clock = max_clock = 0
    next_report = 0.0
    while (event := pop()) is not None:
        t, w = event
        if t > seconds:
            break
        events += 1
        c = clock[w] = clock[w] + 1
        if c == len(counts):
            counts.append(0)
            max_clock = c
        counts[c] += 1
        counts[c - 1] -= 1
        min_rose = c - 1 == min_clock and counts[c - 1] == 0
        if min_rose:
            min_clock = c
        if c - min_clock > lead[w]:
            lead[w] = c - min_clock
        if keep_durations:
            durations[w].append(t - started[w])
        slow["min"], slow["max"] = min_clock, max_clock
        if on_completed is not None:
            on_completed(w, t)
        on_complete(t, w, min_rose)
        if progress is not None and t >= next_report:
            progress(t)
            next_report = t + seconds / 100
        if should_stop is not None and should_stop():
            seconds = t
            break
    for v in range(n):
        if waiting[v]:
            wait_total[v] += seconds - wait_since[v]
    if progress is not None:
        progress(seconds)
    return Result(
        spec=spec,
        timing=timing,
        workers=n,
        seconds=seconds,
        seed=seed,
        final_step=clock,
        wait_seconds=wait_total,
        max_gap=lead,
        events=events,
        checks=stats["checks"],
    )
