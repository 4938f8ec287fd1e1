"""Which connections a member's endpoint keeps: pending handshakes counted apart from
authenticated channels (pure decisions; the endpoint does the I/O).

Anyone who reaches the port can open connections; only the round's secret makes one a
channel. A flood of idle connections used to fill the one connection cap, so no real
caller got in (issue 28: 0 of 48 handshakes). Now:

- channels (the caller's proof arrived) have their own cap, the endpoint's
  `max_connections`;
- pending handshakes have theirs, `max(128, 2 * channels)`, and one source address
  holds at most half of it;
- a newcomer is never turned away: the oldest pending one makes room (of the
  newcomer's own source if that source holds its half, else of the source holding
  the most). A real caller answers the challenge at once, so a flood (idle, or
  trickling bytes) only churns its own connections;
- a pending connection silent for `first_byte` seconds, or unfinished after
  `handshake` seconds, is dropped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

FIRST_BYTE_TIMEOUT = 2.0  # seconds a new connection may stay silent
MIN_PENDING = 128


@dataclass
class _Pending:
    source: str
    since: float
    heard: bool = False


class Admission:
    """The endpoint's books: its pending handshakes (by id, in arrival order) and how many
    channels are open. Not thread-safe: the endpoint holds its lock around each call."""

    def __init__(self, channels: int, handshake: float, first_byte: float = FIRST_BYTE_TIMEOUT):
        if channels < 1:
            raise ValueError(f"max_connections must be at least 1, got {channels}")
        self.channel_cap = channels
        self.pending_cap = max(MIN_PENDING, 2 * channels)
        self.per_source = self.pending_cap // 2
        self.handshake = handshake
        self.first_byte = min(first_byte, handshake)
        self.channels = 0
        self._pending: dict[int, _Pending] = {}  # insertion order: arrival order

    @property
    def pending(self) -> int:
        return len(self._pending)

    def arrive(self, conn: int, source: str, now: float) -> list[int]:
        """Admit the new connection `conn` from `source`; the pending ones to drop to make
        room for it (already forgotten here). A newcomer is never turned away: pending
        ones are callers that have not proven anything, and a real one stays pending for
        a round trip only."""
        if sum(1 for p in self._pending.values() if p.source == source) >= self.per_source:
            victim = self._oldest(source)
        elif len(self._pending) >= self.pending_cap:
            busiest = Counter(p.source for p in self._pending.values()).most_common(1)[0][0]
            victim = self._oldest(busiest)
        else:
            victim = None
        if victim is not None:
            del self._pending[victim]
        self._pending[conn] = _Pending(source, now)
        return [] if victim is None else [victim]

    def _oldest(self, source: str) -> int | None:
        """The source's oldest pending connection, silent or not: by age alone, as a real
        caller is silent too until its proof is read (preferring silent ones would drop
        it first under a flood that trickles bytes)."""
        return next((c for c, p in self._pending.items() if p.source == source), None)

    def heard(self, conn: int) -> None:
        """The caller of `conn` sent its first bytes."""
        if conn in self._pending:
            self._pending[conn].heard = True

    def leave(self, conn: int) -> None:
        """`conn` is no longer pending (closed, or its proof arrived)."""
        self._pending.pop(conn, None)

    def deadline(self, conn: int) -> float:
        pending = self._pending[conn]
        return pending.since + (self.handshake if pending.heard else self.first_byte)

    def expired(self, now: float) -> list[int]:
        """The pending connections past their deadline (forgotten here: to be closed)."""
        late = [conn for conn in self._pending if self.deadline(conn) <= now]
        for conn in late:
            del self._pending[conn]
        return late

    def next_deadline(self) -> float | None:
        """When the next pending connection expires (None: none pending)."""
        return min((self.deadline(conn) for conn in self._pending), default=None)

    def open_channel(self) -> bool:
        """Count one more channel, unless the cap is reached (then False)."""
        if self.channels >= self.channel_cap:
            return False
        self.channels += 1
        return True

    def close_channel(self) -> None:
        self.channels -= 1
