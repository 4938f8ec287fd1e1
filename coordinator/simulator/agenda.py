"""The simulator's event queue: (time, worker) completions, popped in that order.

A calendar of time slots: the order a heap of (time, worker) tuples gives, at half the
cost with 100,000 workers (see `agenda`).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable

_PER_SLOT = 256


def agenda(
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
