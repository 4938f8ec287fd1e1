"""Which etcd calls have outlived their deadlines: the sign of a client that is wedged,
not of an etcd that is merely down.

Every attempt of a request carries a gRPC deadline, so in an ordinary outage or an
election each attempt ends at its deadline (and the request is retried or refused).
An attempt still running `STALL_ALLOWANCE` seconds past its deadline means the
deadline itself no longer works (a starved host once kept calls hanging for 13
minutes past 0.75 s deadlines): the service then reports itself stalled, so
`/healthz` fails and an orchestrator restarts it. The allowance is seconds, not
milliseconds, so that a busy host or a slow answer at the deadline never flips it.

The bookkeeping is a dict under a lock: asking `stalled` never waits on etcd.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Mapping

#: Seconds an attempt may run past its deadline before the client counts as stalled.
STALL_ALLOWANCE = 3.0


def most_overdue(limits: Mapping[int, tuple[str, float]], now: float) -> tuple[str, float] | None:
    """The call furthest past its limit and by how many seconds (None: none is past).
    `limits`: call -> (what it is, the monotonic time by which it must have ended)."""
    late = [(now - limit, what) for what, limit in limits.values() if now > limit]
    if not late:
        return None
    seconds, what = max(late)
    return what, seconds


class Watchdog:
    """The in-flight calls of one etcd client, each with the time it must end by."""

    def __init__(
        self, allowance: float = STALL_ALLOWANCE, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.allowance, self._clock = allowance, clock
        self._lock = threading.Lock()
        self._limits: dict[int, tuple[str, float]] = {}
        self._ids = itertools.count()

    @contextlib.contextmanager
    def call(self, what: str, deadline: float) -> Iterator[None]:
        """Track one call whose deadline is `deadline` seconds from now."""
        ident = next(self._ids)
        with self._lock:
            self._limits[ident] = (what, self._clock() + deadline + self.allowance)
        try:
            yield
        finally:
            with self._lock:
                del self._limits[ident]

    def stalled(self) -> str | None:
        """Why the client is stalled (a call that outlived its deadline), or None."""
        with self._lock:
            found = most_overdue(self._limits, self._clock())
        if found is None:
            return None
        what, seconds = found
        return (
            f"an etcd call ({what}) is {seconds + self.allowance:.1f}s past its deadline: "
            "the client is wedged"
        )

    def in_flight(self) -> int:
        with self._lock:
            return len(self._limits)
