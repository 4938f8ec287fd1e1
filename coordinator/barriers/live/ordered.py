"""BSP and SSP on etcd: each worker needs only the job's slowest clock.

Keys, under `<root><round>/`:

- `order/<clock>/<rank>`: the worker's `Clock` value, leased; one key per
  worker, moved up at every step, so the lowest key is the slowest worker. A
  finished worker's key moves to the top (`DONE`), where it constrains nobody.
- `slowest`: the job-wide slowest clock, raised by the one worker that leaves
  the lowest level last.

Each step is one transaction: move the order key up, read the lowest order
key; if this worker was alone at the lowest level, the same transaction raises
`slowest`. Everyone keeps one watch on `slowest`, so a step costs each worker
one request and one notification, whatever P is (watching every clock would
cost P notifications per worker per step).
"""

from __future__ import annotations

import time

from coordinator.barriers.live.base import LiveBarrier
from coordinator.barriers.live.records import DONE, Passage
from coordinator.barriers.policy import Method, may_start
from coordinator.etcd.txn import Delete, Empty, First, KeyValue, Put, prefix_end
from coordinator.etcd.watch import WatchEvent
from coordinator.keys import rank_of


class OrderedBarrier(LiveBarrier, methods=(Method.BSP, Method.SSP)):
    """BSP/SSP: wait until the job's slowest clock is within the staleness."""

    def _setup(self) -> None:
        self._level: int | None = None  # this worker's order level
        self._slowest = -1  # the highest job-wide slowest clock known

    def _lowest(self) -> First:
        """The read of the lowest order key: the slowest worker."""
        return First(self.keys.order, prefix_end(self.keys.order))

    def _level_of(self, kv: KeyValue | None) -> int:
        return self.keys.level_of(kv.key) if kv is not None else DONE

    # -- publishing and reading -------------------------------------------

    def _after_start_barrier(self) -> None:
        # Everyone has published by now, so the lowest order key is exact.
        revision = self._refresh_slowest()
        self._watch(self.keys.slowest, self._slowest_raised, revision + 1, prev_kv=False)

    def _write_clock(self, value: str, done: bool, stepped: bool) -> int:
        """Move this worker's order key up to its new clock, in one transaction.

        The lowest order key is the slowest worker. Only the worker that was
        alone at the lowest level can raise the job's slowest clock, so it, and
        only it, writes `slowest` (in the same transaction when the new minimum
        is the next clock, as it always is under BSP; with a second put when the
        rest had already moved further).
        """
        level = DONE if done else self.clock
        lease = self.member.lease_id
        moved = [Put(self.keys.ordered(level, self.rank), value, lease), self._lowest()]
        old = self._level
        if old is None:
            result = self.etcd.transaction(moved)
        else:
            mine = self.keys.ordered(old, self.rank)
            moved.insert(1, Delete(mine))
            below_me = Empty(self.keys.order, mine.encode())
            beside_me = Empty(mine + "\0", prefix_end(self.keys.level(old)))
            raise_it = Put(self.keys.slowest, str(old + 1))
            result = self.etcd.transaction(
                [*moved, raise_it], when=[below_me, beside_me], otherwise=moved
            )
        self._level = level
        lowest = self._level_of(result.reads[0])
        if result.succeeded and old is not None and lowest > old + 1:
            self.etcd.put(self.keys.slowest, str(lowest))
        self._slowest = max(self._slowest, lowest)
        return result.revision

    def _refresh_slowest(self) -> int:
        """Read the lowest order key (after the start barrier, or after a loss)."""
        result = self.etcd.transaction([self._lowest()])
        self._slowest = max(self._slowest, self._level_of(result.reads[0]))
        return result.revision

    def _slowest_ranks(self) -> list[int]:
        """Who is at the lowest level now (read only to name them in a timeout)."""
        ordered, _ = self.etcd.get_prefix(self.keys.order)
        levels = {kv.key: self._level_of(kv) for kv in ordered}
        low = min(levels.values(), default=DONE)
        return sorted(rank_of(key) for key, level in levels.items() if level == low)

    # -- the decision -----------------------------------------------------

    def _wait(self, started: float) -> Passage:
        deadline = started + self.timeout
        while not may_start(self.clock, [self._slowest], self.spec.bound):
            self.counters.waits += 1
            self._apply_next(deadline, self._slowest_ranks)
        return Passage(self.clock, self._slowest, {}, time.monotonic() - started)

    # -- events -----------------------------------------------------------

    def _slowest_raised(self, events: list[WatchEvent]) -> None:
        self._slowest = max([self._slowest, *(int(e.value) for e in events if e.value)])

    def _after_losses(self) -> None:
        self._refresh_slowest()  # a lost slowest worker raises the minimum unannounced
