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
  O(log P) per event instead of O(P).
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

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

from coordinator.barriers import dssp
from coordinator.barriers.policy import BarrierSpec, Method, SampleTiming, draw_sample, may_start
from coordinator.simulator.delays import DelayModel, ShiftedExponential

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


class _Others(Sequence[int]):
    """The workers other than `me`, as a sequence that costs O(1) to build."""

    def __init__(self, total: int, me: int) -> None:
        self._n = total - 1
        self._me = me

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return i if i < self._me else i + 1


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

    `exact_checks` makes per-check re-checks of waiting workers draw their
    sample through the decision code instead of an equivalent probability.
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
    draw = delay.sample

    clock = [0] * n
    counts = [n]  # counts[c]: workers whose clock is c
    lead = [0] * n
    waiting = [False] * n
    wait_since = [0.0] * n
    wait_total = [0.0] * n
    started = [0.0] * n
    durations: list[list[float]] = [[] for _ in range(n)]
    heap = [(draw(w, 1, rngs[w]), w) for w in range(n)]
    heapq.heapify(heap)
    heappush, heappop = heapq.heappush, heapq.heappop
    stats = {"checks": 0}
    slow = {"min": 0, "max": 0}
    keep_durations = spec.method == Method.DSSP
    hooks = hooks or Hooks()
    on_started, on_completed, should_stop = hooks.started, hooks.completed, hooks.stop
    if on_started is not None:
        for w in range(n):
            on_started(w, 0.0)

    def start(v: int, t: float) -> None:
        if waiting[v]:
            waiting[v] = False
            wait_total[v] += t - wait_since[v]
        started[v] = t
        if on_started is not None:
            on_started(v, t)
        heappush(heap, (t + draw(v, clock[v] + 1, rngs[v]), v))

    def wait(v: int, t: float) -> None:
        waiting[v] = True
        wait_since[v] = t

    on_complete = _strategy(
        spec,
        timing,
        n,
        clock,
        counts,
        exact_checks,
        start,
        wait,
        sample_rng,
        stats,
        slow,
        durations,
    )

    events = 0
    min_clock = max_clock = 0
    next_report = 0.0
    while heap:
        t, w = heap[0]
        if t > seconds:
            break
        heappop(heap)
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


def _strategy(
    spec: BarrierSpec,
    timing: SampleTiming,
    n: int,
    clock: list[int],
    counts: list[int],
    exact: bool,
    start: Callable[[int, float], None],
    wait: Callable[[int, float], None],
    sample_rng: random.Random,
    stats: dict[str, int],
    slow: dict[str, int],
    durations: list[list[float]],
) -> Callable[[float, int, bool], None]:
    """The per-completion step of one method: check the worker, re-check the waiting."""
    bound = spec.bound

    if spec.method == Method.ASP:

        def asp(t: float, w: int, min_rose: bool) -> None:
            stats["checks"] += 1
            if may_start(clock[w], (), bound):
                start(w, t)

        return asp

    if spec.sampled and timing == SampleTiming.PER_CHECK:
        return _per_check(spec, n, clock, counts, start, wait, sample_rng, stats, slow, exact)
    if spec.sampled:
        return _per_step(spec, n, clock, start, wait, sample_rng, stats)
    return _bucketed(spec, n, clock, start, wait, stats, slow, durations)


def _per_check(
    spec: BarrierSpec,
    n: int,
    clock: list[int],
    counts: list[int],
    start: Callable[[int, float], None],
    wait: Callable[[int, float], None],
    rng: random.Random,
    stats: dict[str, int],
    slow: dict[str, int],
    exact: bool,
) -> Callable[[float, int, bool], None]:
    """Fresh sample of all P workers (itself included) at every check; all waiting re-checked.

    A worker's own check after a completion always runs the decision code. A
    re-check of a waiting worker with clock c passes iff its fresh sample holds
    none of the L workers whose clock is below c - s: probability
    C(P - L, beta) / C(P, beta). With `exact` the re-check draws that sample
    through the decision code (about 5 us each); otherwise it draws one uniform
    against that probability (same distribution, ~50x cheaper), drawing nothing
    when the outcome is certain, so beta = 0 and beta >= P stay deterministic.
    """
    bound, beta, population = spec.bound, spec.sample, range(n)
    assert bound is not None
    waiting: dict[int, int] = {}  # worker -> clock; insertion order: a deterministic order
    uniform = rng.random

    def passes(v: int) -> bool:
        return may_start(clock[v], [clock[p] for p in draw_sample(rng, population, beta)], bound)

    def pass_probability(c: int) -> float:
        laggers = sum(counts[slow["min"] : max(c - bound, 0)])
        if laggers == 0 or beta == 0:
            return 1.0
        if n - laggers < beta:
            return 0.0
        p = 1.0
        for i in range(beta):
            p *= (n - laggers - i) / (n - i)
        return p

    def on_complete(t: float, w: int, min_rose: bool) -> None:
        if waiting:
            stats["checks"] += len(waiting)
            if exact:
                released = [v for v in waiting if passes(v)]
            else:
                chance: dict[int, float] = {}
                released = []
                for v, c in waiting.items():
                    p = chance.get(c)
                    if p is None:
                        p = chance[c] = pass_probability(c)
                    if p >= 1.0 or (p > 0.0 and uniform() < p):
                        released.append(v)
            for v in released:
                del waiting[v]
                start(v, t)
        stats["checks"] += 1
        if passes(w):
            start(w, t)
        else:
            waiting[w] = clock[w]
            wait(w, t)

    return on_complete


def _per_step(
    spec: BarrierSpec,
    n: int,
    clock: list[int],
    start: Callable[[int, float], None],
    wait: Callable[[int, float], None],
    rng: random.Random,
    stats: dict[str, int],
) -> Callable[[float, int, bool], None]:
    """One sample of the others per step, kept for the wait; re-checked as a sampled peer moves."""
    bound, beta = spec.bound, spec.sample
    sample: list[list[int]] = [[] for _ in range(n)]
    token = [0] * n  # bumped on release: stale watch entries are skipped
    watchers: list[list[tuple[int, int]]] = [[] for _ in range(n)]

    def on_complete(t: float, w: int, min_rose: bool) -> None:
        watching = watchers[w]
        if watching:
            keep = []
            for v, tok in watching:
                if token[v] != tok:
                    continue
                stats["checks"] += 1
                if may_start(clock[v], [clock[p] for p in sample[v]], bound):
                    token[v] += 1
                    start(v, t)
                else:
                    keep.append((v, tok))
            watchers[w] = keep
        stats["checks"] += 1
        mine = draw_sample(rng, _Others(n, w), beta)
        if may_start(clock[w], [clock[p] for p in mine], bound):
            start(w, t)
            return
        sample[w] = mine
        wait(w, t)
        entry = (w, token[w])
        for p in mine:
            watchers[p].append(entry)

    return on_complete


def _bucketed(
    spec: BarrierSpec,
    n: int,
    clock: list[int],
    start: Callable[[int, float], None],
    wait: Callable[[int, float], None],
    stats: dict[str, int],
    slow: dict[str, int],
    durations: list[list[float]],
) -> Callable[[float, int, bool], None]:
    """BSP, SSP, DSSP: waiting workers bucketed by clock, released when the slowest catches up."""
    is_dssp = spec.method == Method.DSSP
    bound = spec.staleness
    buckets: dict[int, list[int]] = {}
    credit = [dssp.Credit() for _ in range(n)] if is_dssp else []
    last_push = [0.0] * n

    def pushes(v: int) -> dssp.Pushes:
        recent = durations[v][-DSSP_WINDOW:]
        interval = sum(recent) / len(recent) if recent else 0.0
        return dssp.Pushes(clock[v], last_push[v], interval)

    def passes(v: int, t: float) -> bool:
        stats["checks"] += 1
        low = slow["min"]
        if not is_dssp:
            return may_start(clock[v], (low,), bound)
        c = clock[v]
        fastest = c >= slow["max"]
        grant = 0
        mine = credit[v]
        if fastest and c - low > bound and not mine.remaining and not mine.granted_this_episode:
            slowest = max(
                (pushes(u) for u in range(n) if clock[u] == low),
                key=lambda p: p.last_push + p.interval,
            )
            grant = dssp.extra_steps(pushes(v), slowest, t, bound, spec.staleness_upper)
        return dssp.decide(c, low, fastest, mine, grant, bound)

    def on_complete(t: float, w: int, min_rose: bool) -> None:
        last_push[w] = t
        if min_rose:
            for v in buckets.pop(slow["min"] + bound, ()):
                if not passes(v, t):  # cannot happen: the slowest just reached clock - bound
                    raise AssertionError(f"released worker {v} refused at clock {clock[v]}")
                start(v, t)
        if passes(w, t):
            start(w, t)
        else:
            buckets.setdefault(clock[w], []).append(w)
            wait(w, t)

    return on_complete
