"""A session: one lease, renewed in the background, that says when it is lost.

Everything a member writes is bound to its session's lease, so a member that
crashes disappears from etcd within the TTL instead of leaving stale keys.
The member itself must stop acting once its lease is gone (others may already
have judged it dead), so `lost` is set as soon as either etcd says the lease is
gone or no renewal has been confirmed for a whole TTL.

`proven_for()` says how much longer the lease is certain to live in etcd:
etcd counts a renewal's TTL from when it receives it, which is after we sent
it, so the lease lives at least until the last confirmed renewal's sending
time plus the TTL etcd answered. A holder that must not act once others may
have taken its place (the service's leader) checks it before each act.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError

log = logging.getLogger(__name__)

#: etcd's smallest TTL with default settings; shorter requests are rounded up.
MIN_TTL = 2


class LeaseHolder:
    """A lease someone writes with, and who must hear once it is lost."""

    def __init__(self, lease_id: int) -> None:
        self.lease_id = lease_id
        self.lost = threading.Event()
        self.lost_reason = ""
        self._listeners: list[Callable[[str], None]] = []

    def on_lost(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` once if the lease is lost (at once if it already is)."""
        self._listeners.append(listener)
        if self.lost.is_set():
            listener(self.lost_reason)

    def mark_lost(self, reason: str) -> None:
        """Say the lease is lost, once, to every listener."""
        if self.lost.is_set():
            return
        self.lost_reason = reason
        self.lost.set()
        for listener in self._listeners:
            listener(reason)


class Session(LeaseHolder):
    """A lease of our own, renewed in the background until `close`."""

    def __init__(self, etcd: Etcd, ttl: int = 10) -> None:
        if ttl < MIN_TTL:
            raise ValueError(f"lease ttl must be at least {MIN_TTL}s, got {ttl}")
        self.etcd = etcd
        self.ttl = ttl
        asked = time.monotonic()
        super().__init__(etcd.grant_lease(ttl))
        self._stop = threading.Event()
        self._valid_until = asked + ttl  # monotonic: the lease lives in etcd at least until
        self._thread = threading.Thread(target=self._keepalive, daemon=True, name="etcd-keepalive")
        self._thread.start()

    def _keepalive(self) -> None:
        interval = self.ttl / 3
        # Long enough for a member to find a new leader (renewals wait for one), short
        # enough to try another member well within the TTL.
        attempt = min(self.etcd.timeout, max(self.etcd.attempt_timeout, self.ttl / 3))
        last_failure = ""
        while not self._stop.wait(interval):
            sent = time.monotonic()
            try:
                remaining = self.etcd.keepalive(self.lease_id, timeout=attempt)
            except Exception as exc:  # a transient failure; judged by the deadline below
                log.debug("keepalive failed: %s", exc)
                last_failure = str(exc)
                remaining = None
                interval = min(0.5, self.ttl / 3)  # the client moved on: try the next member
            else:
                interval = self.ttl / 3
            if remaining == 0:
                self._mark_lost(f"lease {self.lease_id:x} expired in etcd")
                return
            if remaining is not None:
                self._valid_until = max(self._valid_until, sent + remaining)
            elif time.monotonic() > self._valid_until:
                self._mark_lost(
                    f"no lease renewal confirmed by etcd for {self.ttl}s; "
                    f"etcd unavailable: {last_failure}"
                )
                return

    def proven_for(self) -> float:
        """Seconds the lease is still certain to live in etcd (0 once lost or overdue)."""
        if self.lost.is_set():
            return 0.0
        return max(0.0, self._valid_until - time.monotonic())

    def _mark_lost(self, reason: str) -> None:
        if not self._stop.is_set():  # closing: no longer ours to lose
            self.mark_lost(reason)

    def close(self, revoke: bool = True) -> None:
        """Stop renewing; with `revoke`, delete every key bound to the lease now."""
        self._stop.set()
        self._thread.join(timeout=self.etcd.timeout + 1)
        if revoke and not self.lost.is_set():
            try:
                self.etcd.revoke_lease(self.lease_id)
            except EtcdError as exc:
                log.warning(
                    "could not revoke lease %x (it expires in %ds): %s",
                    self.lease_id,
                    self.ttl,
                    exc,
                )
