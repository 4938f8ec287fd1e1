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

A lease proves little by itself: anyone who can reach etcd may keep any lease
alive (etcd checks no permission on a keep-alive), so a dead leader's lease can be
held up by a stranger for ever. So the leader also rewrites `<ns>/api/heartbeat`
every TTL/3, fenced by its key's creation, and leads only while its last
heartbeat is younger than the TTL less the margin. A standby that sees the same
leader key with the same heartbeat for `TTL + DEPOSE_SLACK` seconds (its own
clock, from when it first saw them) deletes that leader key, guarded by its
creation, and takes the lead: a leader whose lease a stranger keeps alive is
replaced within about TTL + 1 s. The leader stops acting before any standby can
depose it, by the same reasoning as for the lease.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.session import Session
from coordinator.etcd.txn import CreatedAt, Delete, KeyValue, Put
from coordinator.etcd.watch import WatchEvent
from coordinator.keys import Keys

log = logging.getLogger(__name__)
#: Seconds of proven lease a leader keeps in hand: what one act (starting a process,
#: recording it) may take before the lease could have expired.
DEFAULT_MARGIN = 1.0
#: Seconds past the TTL a standby waits on an unchanged heartbeat before it deposes.
DEPOSE_SLACK = 0.5
#: Seconds at most between a standby's looks at the heartbeat.
LOOK_EVERY = 0.25


@dataclass
class Sighting:
    """What a standby last saw of the leader: its key's creation and its heartbeat's
    revision, and when (its own monotonic clock) it first saw that pair."""

    leader_created: int
    heartbeat_revision: int
    since: float


def sighted(previous: Sighting | None, leader_created: int, heartbeat: int, now: float) -> Sighting:
    """The sighting after a look: the same one while nothing changed, else a new one."""
    if previous is not None and (previous.leader_created, previous.heartbeat_revision) == (
        leader_created,
        heartbeat,
    ):
        return previous
    return Sighting(leader_created, heartbeat, now)


def overdue(sighting: Sighting, ttl: float, now: float) -> bool:
    """Whether the leader seen has not beaten for longer than it may lead unproven."""
    return now - sighting.since > ttl + DEPOSE_SLACK


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
        self.heartbeat_key = Keys(etcd.namespace).heartbeat
        self._beat_sent = 0.0  # monotonic: when our last confirmed heartbeat was sent
        self._sighting: Sighting | None = None  # a standby's view of the leader
        self._stop = threading.Event()
        self._beat_now = threading.Event()
        self._beater = threading.Thread(target=self._beat, daemon=True, name="leader-heartbeat")
        self._beater.start()

    def _on_change(self, events: list[WatchEvent]) -> None:
        self._changed.set()

    @property
    def leading(self) -> bool:
        """This replica holds the key, and its lease and heartbeat are proven for more
        than `margin`."""
        return self._holding and self.proven_for() > self.margin

    def proven_for(self) -> float:
        """Seconds our lease is certain to live and no standby may depose us (0 without
        a lease)."""
        session = self._session
        if session is None:
            return 0.0
        beat_proven = self._beat_sent + self.ttl - time.monotonic()
        return max(0.0, min(session.proven_for(), beat_proven))

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
        if not created and self._depose_if_silent(current):
            created, current, _ = self.etcd.create(self.key, self.replica, self._session.lease_id)
        if not created:
            self._holding, self._created_at = False, 0
        elif not self._holding or current.create_revision != self._created_at:
            self._holding, self._created_at = True, current.create_revision
            self._sighting = None
            self._write_heartbeat()  # the first at once: leading needs one
        return self.leading

    def _depose_if_silent(self, leader: KeyValue) -> bool:
        """As a standby: delete the leader key if its heartbeat has stood still for too
        long (only that key, by its creation); True if it went."""
        heartbeat = self.etcd.get(self.heartbeat_key)
        now = time.monotonic()
        revision = heartbeat.mod_revision if heartbeat is not None else 0
        self._sighting = sighted(self._sighting, leader.create_revision, revision, now)
        if not overdue(self._sighting, self.ttl, now):
            return False
        result = self.etcd.transaction(
            [Delete(self.key)], when=[CreatedAt(self.key, leader.create_revision)]
        )
        if result.succeeded:
            log.warning(
                "deposed leader %s: no heartbeat for %.1fs though its lease lives",
                leader.value.decode(errors="replace"),
                now - self._sighting.since,
            )
        self._sighting = None
        return result.succeeded

    def _write_heartbeat(self) -> None:
        """One heartbeat, fenced by our key's creation; a write refused by the fence
        means we were deposed."""
        session, created = self._session, self._created_at
        if session is None or not self._holding:
            return
        sent = time.monotonic()
        value = json.dumps({"replica": self.replica, "leader_created": created})
        result = self.etcd.transaction(
            [Put(self.heartbeat_key, value, session.lease_id)],
            when=[CreatedAt(self.key, created)],
        )
        if result.succeeded:
            self._beat_sent = max(self._beat_sent, sent)
        elif self._created_at == created:
            log.warning("leader key %s is no longer ours: we were deposed", self.key)
            self._holding = False

    def _beat(self) -> None:
        """The leader's heartbeat, every TTL/3 while it holds the key."""
        while not self._stop.is_set():
            self._beat_now.wait(self.ttl / 3)
            self._beat_now.clear()
            if self._stop.is_set():
                return
            try:
                self._write_heartbeat()
            except EtcdError as exc:  # judged by `proven_for`: no fresh beat, no lead
                log.debug("heartbeat failed: %s", exc)

    def wait_for_change(self, timeout: float) -> None:
        """Until the leader key changes (its holder left), or `timeout`, or it is time to
        look at the leader's heartbeat again."""
        self._changed.wait(min(timeout, LOOK_EVERY))

    def close(self) -> None:
        self._stop.set()
        self._beat_now.set()
        self._beater.join(self.etcd.timeout + 1)
        self._watch.cancel()
        if self._session is not None:
            with contextlib.suppress(EtcdError):
                self._session.close(revoke=True)
            self._session = None
