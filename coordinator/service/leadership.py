"""Which replica runs the reconciler: the one holding `<ns>/api/leader` under its lease.

Every replica serves the API; only the leader starts and stops members. A
leader that dies loses the key within its lease TTL and another replica takes
over.

A leader cut off from etcd cannot hear that it lost: another replica takes the
key once the lease expires in etcd. So a leader leads only while it can prove
its lease still lives: `leading` turns false once the last confirmed renewal
leaves less than `margin` seconds (see `Session.proven_for`), before the lease
can have expired and anyone else can have been elected. The reconciler asks
before each job's step and each member it starts. Every change it makes to a
job is a compare-and-swap, and those that start an attempt or record a started
member are also fenced by the leader key's creation (`fence`): a late write
from a deposed leader cannot start anything.
"""

from __future__ import annotations

import contextlib
import threading

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.session import Session
from coordinator.etcd.txn import CreatedAt
from coordinator.etcd.watch import WatchEvent
from coordinator.keys import Keys

#: Seconds of proven lease a leader keeps in hand: what one act (starting a process,
#: recording it) may take before the lease could have expired.
DEFAULT_MARGIN = 1.0


class Leadership:
    def __init__(self, etcd: Etcd, replica: str, ttl: int = 5, margin: float | None = None) -> None:
        """`margin`: [DEFAULT_MARGIN, at most a quarter of the TTL]."""
        margin = min(DEFAULT_MARGIN, ttl / 4) if margin is None else margin
        if not 0 <= margin < ttl / 2:
            raise ValueError(f"leadership margin {margin}s must be under half the TTL ({ttl}s)")
        self.etcd, self.replica, self.ttl, self.margin = etcd, replica, ttl, margin
        self.key = Keys(etcd.namespace).leader
        self._session: Session | None = None  # kept while waiting to lead, too
        self._holding = False
        self._created_at = 0  # the leader key's create revision while we hold it
        self._changed = threading.Event()
        self._watch = etcd.watch(self.key, self._on_change, start_revision=0)

    def _on_change(self, events: list[WatchEvent]) -> None:
        self._changed.set()

    @property
    def leading(self) -> bool:
        """This replica holds the key and its lease is proven for more than `margin`."""
        return self._holding and self.proven_for() > self.margin

    def proven_for(self) -> float:
        """Seconds our lease is certain to live (0 without one)."""
        session = self._session
        return 0.0 if session is None else session.proven_for()

    def fence(self) -> list[CreatedAt]:
        """The guard that makes a write count only while we still hold the key we took."""
        return [CreatedAt(self.key, self._created_at)] if self._holding else []

    def try_to_lead(self) -> bool:
        """Take the key if it is free (or ours already); True while this replica leads."""
        if self.leading:
            return True
        if self._session is None or self._session.lost.is_set():
            if self._session is not None:  # lost while leading: start over with a new lease
                self._session.close(revoke=False)
            self._holding = False
            self._session = Session(self.etcd, self.ttl)
        self._changed.clear()
        created, current, _ = self.etcd.create(self.key, self.replica, self._session.lease_id)
        self._holding = created
        self._created_at = current.create_revision if created else 0
        return self.leading

    def wait_for_change(self, timeout: float) -> None:
        """Until the leader key changes (its holder left), or `timeout`."""
        self._changed.wait(timeout)

    def close(self) -> None:
        self._watch.cancel()
        if self._session is not None:
            with contextlib.suppress(EtcdError):
                self._session.close(revoke=True)
            self._session = None
