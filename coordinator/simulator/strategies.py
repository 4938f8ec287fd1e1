"""The barrier methods' release rules in the simulator: what happens at each completion.

`strategy` gives, for one method, the handler the engine calls at every step completion:
it asks the shared decision code (`coordinator.barriers.policy`, `coordinator.barriers.dssp`)
whether the worker may start its next step, and re-checks the waiting workers the
completion may release. The handlers differ only in bookkeeping (which waiters can change
their answer, how sampling is drawn); the semantics are in `coordinator.simulator.engine`'s
docstring.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

from coordinator.barriers import dssp
from coordinator.barriers.policy import BarrierSpec, Method, SampleTiming, draw_sample, may_start

#: `on_complete(t, worker, min_rose)`: the worker completed a step at `t`; `min_rose`: the
#: slowest clock just went up.
OnComplete = Callable[[float, int, bool], None]


@dataclass(frozen=True)
class Workers:
    """The engine's side of a strategy: the workers' clocks and what it may do with one."""

    n: int
    clock: list[int]  # each worker's clock: the steps it completed
    start: Callable[[int, float], None]  # start(worker, t): its next step begins at t
    wait: Callable[[int, float], None]  # wait(worker, t): it waits from t
    stats: dict[str, int]  # "checks": the decision code's answers so far
    slow: dict[str, int]  # "min", "max": the slowest and the fastest clock


def strategy(
    spec: BarrierSpec,
    timing: SampleTiming,
    workers: Workers,
    exact: bool,
    sample_rng: random.Random,
    durations: list[deque[float]],
) -> OnComplete:
    """The per-completion step of one method: check the worker, re-check the waiting.

    `exact`: per-check sampling draws every check's sample through the decision code;
    `durations`: each worker's last step durations (DSSP only).
    """
    bound = spec.bound
    clock, start, stats = workers.clock, workers.start, workers.stats

    if spec.method == Method.ASP:

        def asp(t: float, w: int, min_rose: bool) -> None:
            stats["checks"] += 1
            if may_start(clock[w], (), bound):
                start(w, t)

        return asp

    if spec.sampled and timing == SampleTiming.PER_CHECK:
        return _per_check(spec, workers, sample_rng, exact)
    if spec.sampled:
        return _per_step(spec, workers, sample_rng)
    return _bucketed(spec, workers, durations)


def _per_check(spec: BarrierSpec, workers: Workers, rng: random.Random, exact: bool) -> OnComplete:
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
    n, clock, start, wait, stats = (
        workers.n, workers.clock, workers.start, workers.wait, workers.stats
    )  # fmt: skip
    bound, beta, population = spec.bound, spec.sample, range(n)
    assert bound is not None

    def passes(v: int) -> bool:
        return may_start(clock[v], [clock[p] for p in draw_sample(rng, population, beta)], bound)

    if exact:
        return _per_check_literal(workers, passes)

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


def _per_check_literal(workers: Workers, passes: Callable[[int], bool]) -> OnComplete:
    """Per-check sampling as written: every waiting worker re-checked through the decision code."""
    clock, start, wait, stats = workers.clock, workers.start, workers.wait, workers.stats
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


def _per_step(spec: BarrierSpec, workers: Workers, rng: random.Random) -> OnComplete:
    """One sample of the others per step, kept for the wait; re-checked as a sampled peer moves."""
    n, clock, start, wait, stats = (
        workers.n, workers.clock, workers.start, workers.wait, workers.stats
    )  # fmt: skip
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


def _bucketed(spec: BarrierSpec, workers: Workers, durations: list[deque[float]]) -> OnComplete:
    """BSP, SSP, DSSP: waiting workers bucketed by clock, released when the slowest catches up."""
    n, clock, start, wait, stats = (
        workers.n, workers.clock, workers.start, workers.wait, workers.stats
    )  # fmt: skip
    slow = workers.slow
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
        """`dssp.slowest_of` the workers at clock `low`, from the heap: its order, (latest
        predicted push, lowest id), is that rule's among workers of one clock."""
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
