"""ASP on etcd: never wait; publish the clock only to show progress.

ASP reads nothing, and publishes its clock (`clocks/<rank>`) at most every
`ASP_PUBLISH_SECONDS`, and when it finishes: nobody waits on it, and a request
per step is a tenth of a small model's step.
"""

from __future__ import annotations

from coordinator.barriers.live.base import LiveBarrier
from coordinator.barriers.live.records import Passage
from coordinator.barriers.policy import Method

ASP_PUBLISH_SECONDS = 0.2


class AspBarrier(LiveBarrier, methods=(Method.ASP,)):
    """ASP: every check passes at once; losses are still seen (and fail or leave the set)."""

    def _setup(self) -> None:
        self._published = 0.0  # wall time of the last clock published after a step

    def _wait(self, started: float) -> Passage:
        return Passage(self.clock, None, {}, 0.0)

    def complete(self) -> None:
        """One more step done: publish it if the last publish is `ASP_PUBLISH_SECONDS` old."""
        now = self._count_step()
        if now - self._published < ASP_PUBLISH_SECONDS:
            return
        self._published = now
        self._publish(done=False, stepped=True)
