"""The placement commits an agent's assignments wait for.

An assignment that names a `placement` (one too big for one etcd transaction, written
ahead of its commit) waits until `<ns>/placements/<placement>` exists: the placement is
then whole. One deleted meanwhile never runs. The commits are watched from the first
placement waited for on; the watch's events go to the agent's main thread
(`on_events`), which tells them here (`commit_seen`, `commit_gone`), so the state
below is only ever touched by that thread.
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.etcd.client import Etcd
from coordinator.etcd.watch import Watch, WatchEvent
from coordinator.keys import Keys


class PlacementCommits:
    def __init__(
        self, etcd: Etcd, keys: Keys, on_events: Callable[[list[WatchEvent]], None]
    ) -> None:
        self.etcd, self.keys = etcd, keys
        self._on_events = on_events
        self._waiting: dict[str, str] = {}  # member name -> the placement it waits for
        self._committed: set[str] = set()  # placements whose commit was seen
        self._watch: Watch | None = None  # made once a placement is waited for

    def is_committed(self, placement: str) -> bool:
        """Whether the placement's commit exists. The commits are watched from the first
        placement waited for on, and the watch is made before the read: a commit is
        seen by the one or the other. (Plain reads, never a read-only transaction:
        etcd before 3.5.5 panics on one that times out under load, etcd#14110.)"""
        if placement in self._committed:
            return True
        if self._watch is None:
            self._watch = self.etcd.watch(
                self.keys.placements, self._on_events,
                start_revision=0, prefix=True, prev_kv=False,
            )  # fmt: skip
        if self.etcd.get(self.keys.placement(placement)) is None:
            return False
        self._committed.add(placement)
        return True

    def wait(self, member: str, placement: str) -> None:
        """`member` waits for `placement`'s commit (or its assignment's deletion)."""
        self._waiting[member] = placement

    def drop(self, member: str) -> None:
        """`member` waits no more: it was handled, or its assignment deleted."""
        self._waiting.pop(member, None)

    def commit_seen(self, placement: str) -> None:
        self._committed.add(placement)

    def commit_gone(self, placement: str) -> None:
        self._committed.discard(placement)

    def ready(self) -> list[str]:
        """The waiting members whose placement is now committed."""
        return [m for m, placement in self._waiting.items() if placement in self._committed]

    def forget(self) -> None:
        """Stop watching, and forget every commit and waiting member (the lease is gone)."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._waiting.clear()
        self._committed.clear()
