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
  group with the same distribution (see `_per_check`).
- Events are kept in a calendar of time slots (`_agenda`), popped in
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

import bisect
import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

from coordinator.barriers import dssp
from coordinator.barriers.policy import BarrierSpec, Method, SampleTiming, draw_sample, may_start
from coordinator.simulator.delays import DelayModel, ShiftedExponential, sampler

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


def _agenda(
    first: list[float],
) -> tuple[Callable[[float, int], None], Callable[[], tuple[float, int] | None]]:
    """The event queue: `push(time, worker)` and `pop()` in (time, worker) order (None: empty).

    A calendar of time slots sized for about `_PER_SLOT` completions each: a push
    appends to its slot, a slot is sorted once when it comes up (a push into the
    current slot is inserted in order). The order is the one a heap of
    (time, worker) tuples gives, at half the cost with 100,000 workers.
    """
    mean = sum(first) / len(first)
    per_slot = min(_PER_SLOT, max(len(first) // 8, 1))
    inv = min(len(first) / (per_slot * mean), 1e9) if mean > 0 else 1.0
    slots: dict[int, list[tuple[float, int]]] = {}
    keys: list[int] = []  # heap of the slots that hold something, but the current one
    batch: list[tuple[float, int]] = []  # the current slot, sorted; batch[i:] still to come
    i = 0
    current = -1
    heappush, heappop, insort = heapq.heappush, heapq.heappop, bisect.insort

    def push(due: float, v: int) -> None:
        k = int(due * inv)
        if k == current:
            insort(batch, (due, v), i)
            return
        slot = slots.get(k)
        if slot is None:
            slots[k] = [(due, v)]
            heappush(keys, k)
        else:
            slot.append((due, v))

    def pop() -> tuple[float, int] | None:
        nonlocal batch, i, current
        if i == len(batch):
            if not keys:
                return None
            current = heappop(keys)
            batch = slots.pop(current)
            batch.sort()
            i = 0
        i += 1
        return batch[i - 1]

    for w, due in enumerate(first):
        push(due, w)
    return push, pop


_PER_SLOT = 256


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
    push, pop = _agenda([draw(w, 1) for w in range(n)])
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
    durations: list[deque[float]],
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

    A check of a worker with clock c passes iff its fresh sample holds none of
    the L workers whose clock is below c - s: probability
    p = C(P - L, beta) / C(P, beta), independently at every check. With
    `exact` every check (the completing worker's own, then every waiting
    worker's re-check) draws that sample through the decision code: about 5 us
    each and O(waiting) per completion. Otherwise, the same distribution:

    - the own check draws one uniform against p (nothing when p is 0 or 1);
    - the re-checks go by clock group (`_Group`): waiters with one clock share
      p. Surviving one re-check has probability 1 - p = exp(-h), h =
      -log(1 - p), so a waiter is released at the first completion where the
      hazard h summed over its re-checks exceeds an Exp(1) threshold; by
      memorylessness the group keeps only its next release level, and whom it
      releases is drawn uniformly. L of group c changes only when a worker's
      clock reaches c - s: one group's h to update per completion. Cost per
      completion: O(clock groups) instead of O(waiting).

    p = 1 releases at the next completion and p = 0 never, so beta = 0 and
    beta >= P stay deterministic (ASP, SSP/BSP bit for bit). The random stream
    differs from the literal one and from the engine before issue 20 (one
    uniform per waiter per completion); the distribution of a run does not
    (tests/system/test_simulator.py::test_event_driven_per_check_has_the_literal_distribution).
    """
    bound, beta, population = spec.bound, spec.sample, range(n)
    assert bound is not None

    def passes(v: int) -> bool:
        return may_start(clock[v], [clock[p] for p in draw_sample(rng, population, beta)], bound)

    if exact:
        return _per_check_literal(clock, start, wait, stats, passes)

    groups: dict[int, _Group] = {}  # clock -> its waiting workers
    cache: dict[int, tuple[float, float]] = {}  # L -> (p, h)
    under = [0, n]  # under[x]: workers whose clock is below x (n beyond the fastest)
    uniform, log = rng.random, math.log
    waiting = 0

    def chance(c: int) -> tuple[float, float]:
        """(p, h) for a check at clock c: pass probability and hazard -log(1 - p)."""
        laggers = under[c - bound] if c > bound else 0
        known = cache.get(laggers)
        if known is None:
            if laggers == 0 or beta == 0:
                known = (1.0, math.inf)
            elif n - laggers < beta:
                known = (0.0, 0.0)
            else:
                p = 1.0
                for i in range(beta):
                    p *= (n - laggers - i) / (n - i)
                known = (p, -math.log1p(-p) if p < 1.0 else math.inf)
            cache[laggers] = known
        return known

    def on_complete(t: float, w: int, min_rose: bool) -> None:
        nonlocal waiting
        c = clock[w]
        if c == len(under):
            under.append(n)
        under[c] -= 1  # w left clock c - 1
        stats["checks"] += waiting + 1  # every waiting worker's re-check, then w's own
        if groups:
            g = groups.get(c + bound)  # the only group whose L just changed
            if g is not None:
                g.rate = chance(c + bound)[1]
            emptied = []
            for at, g in groups.items():
                level = g.level = g.level + g.rate
                threshold = g.next
                if level <= threshold:
                    continue
                members = g.members
                if level == math.inf:  # p = 1: all pass
                    waiting -= len(members)
                    for v in members:
                        start(v, t)
                    members.clear()
                else:  # the lowest threshold is any member's; the next is Exp(1)/m above
                    while threshold < level:
                        m = len(members)
                        j = int(uniform() * m)
                        v = members[j]
                        members[j] = members[-1]
                        members.pop()
                        waiting -= 1
                        start(v, t)
                        if m == 1:
                            break
                        threshold -= log(1.0 - uniform()) / (m - 1)
                    g.next = threshold
                if not members:
                    emptied.append(at)
            for at in emptied:
                del groups[at]
        laggers = under[c - bound] if c > bound else 0
        known = cache.get(laggers)
        p, h = known if known is not None else chance(c)
        if p >= 1.0 or (p > 0.0 and uniform() < p):
            start(w, t)
            return
        g = groups.get(c)
        if g is None:
            g = groups[c] = _Group(h)
        g.members.append(w)
        # w's threshold: the hazard so far + Exp(1) (as rng.expovariate(1.0)); the
        # group's next release is at the lowest threshold
        mine = g.level - log(1.0 - uniform())
        if mine < g.next:
            g.next = mine
        waiting += 1
        wait(w, t)

    return on_complete


class _Group:
    """Waiting workers with one clock, and the hazard summed over their re-checks.

    A waiter leaves at the first completion where `level` exceeds its
    threshold: the level when it started waiting + Exp(1). Thresholds are not
    kept: above the current level the waiters' unspent parts are independent
    Exp(1) (memoryless), so the lowest is the group's `next` release level,
    the waiter it belongs to is any of them with equal chance, and the next
    one above it is `next` + Exp(1) / (waiters left). Same law as one kept
    threshold per waiter, O(1) per join and per release.
    """

    __slots__ = ("level", "members", "next", "rate")

    def __init__(self, rate: float) -> None:
        self.members: list[int] = []  # in no particular order
        self.level = 0.0  # hazard summed over the re-checks so far
        self.rate = rate  # hazard of one re-check: -log(1 - p)
        self.next = math.inf  # the level of the next release


def _per_check_literal(
    clock: list[int],
    start: Callable[[int, float], None],
    wait: Callable[[int, float], None],
    stats: dict[str, int],
    passes: Callable[[int], bool],
) -> Callable[[float, int, bool], None]:
    """Per-check sampling as written: every waiting worker re-checked through the decision code."""
    waiting: dict[int, int] = {}  # worker -> clock; insertion order: a deterministic order

    def on_complete(t: float, w: int, min_rose: bool) -> None:
        if waiting:
            stats["checks"] += len(waiting)
            released = [v for v in waiting if passes(v)]
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
    others = range(n - 1)

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
        # The others by index: draw_sample(rng, _Others(n, w), beta) with the same draws
        # (random.sample only reads len and items), minus a Python __getitem__ per item.
        mine = [p + (p >= w) for p in draw_sample(rng, others, beta)]
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
    durations: list[deque[float]],
) -> Callable[[float, int, bool], None]:
    """BSP, SSP, DSSP: waiting workers bucketed by clock, released when the slowest catches up."""
    is_dssp = spec.method == Method.DSSP
    bound = spec.staleness
    buckets: dict[int, list[int]] = {}
    credit = [dssp.Credit() for _ in range(n)] if is_dssp else []
    last_push = [0.0] * n
    # DSSP's slowest: per clock, a heap of (-predicted push, worker) of the workers that
    # reached it (they leave it, never re-enter: stale entries are dropped lazily). A
    # worker's predicted push is fixed while its clock is: what it had when it got there.
    arrived: dict[int, list[tuple[float, int]]] = {0: [(-0.0, u) for u in range(n)]}
    heappush, heappop = heapq.heappush, heapq.heappop

    def pushes(v: int) -> dssp.Pushes:
        recent = durations[v]  # the last DSSP_WINDOW (a bounded deque)
        interval = sum(recent) / len(recent) if recent else 0.0
        return dssp.Pushes(clock[v], last_push[v], interval)

    def slowest(low: int) -> dssp.Pushes:
        """Among clock `low`, the latest predicted push; the lowest id on a tie (as max())."""
        heap = arrived[low]
        while clock[heap[0][1]] != low:
            heappop(heap)
        return pushes(heap[0][1])

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
            grant = dssp.extra_steps(pushes(v), slowest(low), t, bound, spec.staleness_upper)
        return dssp.decide(c, low, fastest, mine, grant, bound)

    def on_complete(t: float, w: int, min_rose: bool) -> None:
        last_push[w] = t
        if is_dssp:  # as pushes(w).last_push + .interval
            recent = durations[w]
            interval = sum(recent) / len(recent) if recent else 0.0
            heap = arrived.get(clock[w])
            if heap is None:
                heap = arrived[clock[w]] = []
            heappush(heap, (-(t + interval), w))
            if min_rose:
                arrived.pop(slow["min"] - 1, None)
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
