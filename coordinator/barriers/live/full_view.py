"""DSSP on etcd: a local view of every peer's clock, kept by one watch.

DSSP's controller (`coordinator.barriers.dssp`) predicts from the slowest
worker's push times and asks who is fastest, so it needs every clock: one watch
on the `clocks/` prefix for the whole run keeps a local view, so a check costs
no reads at all.

Besides `clocks/<rank>`, each worker keeps `<root>dssp/<rank>`: its credit
(`remaining`, `granted_this_episode`). Not leased and not per round, so a
restarted member continues its episode. A check decides from the view alone,
then stores the credit if the decision changed it.
"""

from __future__ import annotations

import json
import time

from coordinator.barriers.dssp import Credit, Pushes, decide, extra_steps, slowest_of
from coordinator.barriers.live.base import LiveBarrier
from coordinator.barriers.live.records import Clock, Passage
from coordinator.barriers.policy import Method
from coordinator.etcd.watch import WatchEvent
from coordinator.keys import rank_of


class FullViewBarrier(LiveBarrier, methods=(Method.DSSP,)):
    """DSSP: SSP(S_L), plus extra steps for the fastest worker, from every peer's clock."""

    def _setup(self) -> None:
        self._view: dict[int, Clock] = {}  # every peer's clock, as the watch tells it
        self._credit = Credit()

    def _after_start_barrier(self) -> None:
        kv = self.etcd.get(self.keys.credit(self.rank))
        if kv is not None:
            data = json.loads(kv.value)
            self._credit = Credit(data["remaining"], data["granted_this_episode"])
        clocks, revision = self.etcd.get_prefix(self.keys.clocks)
        for kv in clocks:
            self._view[rank_of(kv.key)] = Clock.parse(kv.value)
        for rank in sorted(self.live - set(self._view)):
            self._peer_lost(rank, "its clock vanished before the first step")
        self._watch(
            self.keys.clocks, self._clocks_changed, revision + 1, prefix=True, prev_kv=False
        )

    # -- the decision -----------------------------------------------------

    def _wait(self, started: float) -> Passage:
        deadline = started + self.timeout
        while True:
            before = (self._credit.remaining, self._credit.granted_this_episode)
            observed = self._decide()
            if (self._credit.remaining, self._credit.granted_this_episode) != before:
                self._store_credit()
            if observed is not None:
                slowest = min(observed.values(), default=None)
                return Passage(self.clock, slowest, observed, time.monotonic() - started)
            self.counters.waits += 1
            # Block until the view changes, then decide again.
            self._apply_next(deadline, lambda: sorted(self._unfinished()))

    def _decide(self) -> dict[int, int] | None:
        """The clocks passed on, or None to wait: `dssp.decide` on the view (no request).

        Updates the credit in place; the caller stores it.
        """
        others = self._unfinished()
        observed = {r: c.clock for r, c in others.items()}
        if not others:
            return observed
        pushes = {r: Pushes(c.clock, c.t, c.interval) for r, c in others.items()}
        slowest = pushes[slowest_of(pushes)]
        is_fastest = self.clock >= max(c.clock for c in others.values())
        grant = 0
        s_low, s_high = self.spec.staleness, self.spec.staleness_upper
        if is_fastest and self.clock - slowest.clock > s_low:
            me = Pushes(self.clock, self._last_push, self._mean_interval())
            grant = extra_steps(me, slowest, time.time(), s_low, s_high)
        passed = decide(self.clock, slowest.clock, is_fastest, self._credit, grant, s_low)
        return observed if passed else None

    def _unfinished(self) -> dict[int, Clock]:
        return {r: c for r, c in self._view.items() if r in self.live and not c.done}

    def _store_credit(self) -> None:
        credit = {
            "remaining": self._credit.remaining,
            "granted_this_episode": self._credit.granted_this_episode,
        }
        self.etcd.put(self.keys.credit(self.rank), json.dumps(credit))

    # -- events -----------------------------------------------------------

    def _clocks_changed(self, events: list[WatchEvent]) -> None:
        for event in events:
            rank = rank_of(event.key)
            if event.kind == "put":
                self._view[rank] = Clock.parse(event.value)
            elif rank != self.rank:
                self._peer_lost(rank, "its clock key vanished (its lease ended)")

    def _peer_left(self, rank: int) -> None:
        self._view.pop(rank, None)
