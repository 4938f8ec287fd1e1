"""Which replica runs the reconciler: the one holding `<ns>/api/leader` under its lease.

Every replica serves the API; only the leader starts and stops members. A
leader that dies loses the key within its lease TTL and another replica takes
over. A leader that loses its lease stops leading at once (`leading` turns
false), before another can have been elected; every change it makes to a job
is a compare-and-swap anyway, so a late write from it cannot win a race.
"""

from __future__ import annotations

import contextlib
import threading

from coordinator.etcd.client import Etcd, EtcdError, WatchEvent
from coordinator.etcd.session import Session


class Leadership:
    def __init__(self, etcd: Etcd, replica: str, ttl: int = 5) -> None:
        self.etcd, self.replica, self.ttl = etcd, replica, ttl
        self.key = etcd.key("api", "leader")
        self._session: Session | None = None  # kept while waiting to lead, too
        self._holding = False
        self._changed = threading.Event()
        self._watch = etcd.watch(self.key, self._on_change, start_revision=0)

    def _on_change(self, events: list[WatchEvent]) -> None:
        self._changed.set()

    @property
    def leading(self) -> bool:
        return self._holding and self._session is not None and not self._session.lost.is_set()

    def try_to_lead(self) -> bool:
        """Take the key if it is free; True while this replica leads."""
        if self.leading:
            return True
        if self._session is None or self._session.lost.is_set():
            if self._session is not None:  # lost while leading: start over with a new lease
                self._session.close(revoke=False)
            self._session = Session(self.etcd, self.ttl)
        self._changed.clear()
        created, _, _ = self.etcd.create(self.key, self.replica, self._session.lease_id)
        self._holding = created
        return created

    def wait_for_change(self, timeout: float) -> None:
        """Until the leader key changes (its holder left), or `timeout`."""
        self._changed.wait(timeout)

    def close(self) -> None:
        self._watch.cancel()
        if self._session is not None:
            with contextlib.suppress(EtcdError):
                self._session.close(revoke=True)
            self._session = None
