"""Watches that resume: after a disconnect from their last revision + 1, after a
compaction by re-reading what they watch (see `Watch`), and on a new stream when
the library's stream can no longer be trusted (see `stream.WatchStream`)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pyetcd import etcdrpc
from pyetcd.exceptions import RevisionCompactedError, WatchTimedOut

from coordinator.etcd.errors import EtcdError
from coordinator.etcd.txn import KeyValue, key_value, prefix_end

if TYPE_CHECKING:
    from coordinator.etcd.connection import CallOptions, Connection
    from coordinator.etcd.stream import WatchStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: bytes
    prev_value: bytes
    revision: int
    create_revision: int = 0  # of the key (0 for a delete)


class Watch:
    """A watch that survives disconnects by re-watching from its last revision + 1,
    and compaction by re-reading what it watches.

    `callback` gets lists of `WatchEvent`s, in revision order, from a library
    thread; it must be quick and must not block. With `prev_kv=False` their
    `prev_value` is empty (etcd then need not look it up).

    If the revision to resume from has been compacted, the changes in between are
    gone from etcd's history. The watch then reads the watched keys as they are
    now and delivers the difference from what it last knew as events: a put for
    each key that is new or changed, a delete for each key it knew that is gone
    (with the value it knew). Then it watches from after that read. So no waiter
    misses a condition that became true meanwhile; it may see a key's final
    value without the values in between. To know what is gone, the watch keeps
    the last value of every key it has seen. An `only_deletes` watch gets no puts
    (etcd filters them: N members watching N keys would otherwise get N^2), so it
    reads its keys once when it starts (their names only), and after a compaction
    reports those of them that are gone, with an empty `prev_value`. A caller that
    knows those keys gives them (`known_keys`, and later `expect`) instead: N
    members each reading N keys would cost N^2.
    """

    def __init__(
        self,
        etcd: Connection,
        key: str,
        callback: Callable[[list[WatchEvent]], None],
        start_revision: int,
        prefix: bool = False,
        only_deletes: bool = False,
        prev_kv: bool = True,
        known_keys: Iterable[str] | None = None,
    ) -> None:
        self._etcd = etcd
        self._prev_kv = prev_kv
        self._key = key
        self._start = key.encode()  # (compared with every event's key)
        self._range_end = prefix_end(key) if prefix else None
        self._callback = callback
        self._only_deletes = only_deletes
        self._next_revision = start_revision
        self._known: dict[str, bytes] = {}  # key -> its last value seen
        self._lock = threading.Lock()
        self._closed = False
        self._registered: Registration | None = None
        self._filters = [etcdrpc.WatchCreateRequest.NOPUT] if only_deletes else None
        if only_deletes and known_keys is not None and start_revision != 0:
            self._known = dict.fromkeys(known_keys, b"")
        elif only_deletes or start_revision == 0:
            # "From now" pinned to a revision, so a reconnect resumes there, not at a later
            # "now"; and the keys that exist now, whose deletion must be seen after a
            # compaction too.
            kvs, revision = self._read(keys=only_deletes, values=False)
            self._next_revision = revision + 1 if start_revision == 0 else start_revision
            if only_deletes:
                self._known = {kv.key: b"" for kv in kvs}
        self._register()

    def _read(self, keys: bool = True, values: bool = True) -> tuple[list[KeyValue], int]:
        """The watched keys now (`keys=False`: none, only the revision), and the revision."""
        request = etcdrpc.RangeRequest(
            key=self._key.encode(),
            range_end=self._range_end or b"",
            count_only=not keys,
            keys_only=not values,
        )
        response = self._etcd._call(lambda o: self._etcd._kv().Range(request, **o))
        return [key_value(kv) for kv in response.kvs], response.header.revision

    def expect(self, keys: Iterable[str]) -> None:
        """Also report these keys' deletion if a compaction hides it (`known_keys`)."""
        with self._lock:
            for key in keys:
                self._known.setdefault(key, b"")

    def _register(self) -> None:
        def on_response(response: object) -> None:
            if isinstance(response, RevisionCompactedError):
                self._on_compacted(response.compacted_revision)
                return
            if response is None or isinstance(response, Exception):
                self._on_broken(response)
                return
            events = []
            for event in response.events:  # type: ignore[attr-defined]
                kv, prev = event._event.kv, event._event.prev_kv
                if not self._covers(kv.key):  # (another watch's: see _renew_watcher)
                    log.warning("watch on %s got an event of %r: ignored", self._key, kv.key)
                    continue
                kind: Literal["put", "delete"] = "delete" if event._event.type else "put"
                events.append(
                    WatchEvent(
                        kind,
                        kv.key.decode(),
                        kv.value,
                        prev.value,
                        kv.mod_revision,
                        kv.create_revision,
                    )
                )
            if not events:
                return
            with self._lock:
                if self._closed:
                    return
                self._next_revision = events[-1].revision + 1
                self._remember(events)
            self._callback(events)

        def add(_: CallOptions) -> Registration:
            # One registration at a time per client: the library's watcher lets a second
            # one, which waited for the first, queue its request to a stream that died
            # meanwhile (as all do when a member dies), where it times out unanswered.
            with self._etcd._watch_lock:
                watcher = self._etcd._watcher()
                try:
                    watch_id = watcher.add_callback(
                        self._key,
                        on_response,
                        range_end=self._range_end,
                        start_revision=self._next_revision,
                        filters=self._filters,
                        prev_kv=self._prev_kv,
                    )
                    return Registration(watcher, watch_id, on_response)
                except WatchTimedOut:
                    self._etcd._renew_watcher(watcher)
                    raise

        try:
            registered = self._etcd._call(add)
        except RevisionCompactedError as exc:  # compacted before the watch was created
            self._resync(exc.compacted_revision)
            self._register()
            return
        with self._lock:
            closed = self._closed
            if not closed:
                self._registered = registered
        if closed:  # cancelled while this registration was on its way
            registered.cancel()

    def _covers(self, key: bytes) -> bool:
        if self._range_end is None:
            return key == self._start
        return self._start <= key < self._range_end

    def _remember(self, events: list[WatchEvent]) -> None:
        for event in events:
            if event.kind == "put":
                self._known[event.key] = event.value
            else:
                self._known.pop(event.key, None)

    def _on_compacted(self, compacted: int) -> None:
        with self._lock:
            if self._closed:
                return
        threading.Thread(
            target=self._resync_and_resume, args=(compacted,), daemon=True, name="etcd-watch-resync"
        ).start()

    def _resync_and_resume(self, compacted: int) -> None:
        try:
            self._resync(compacted)
        except EtcdError as exc:
            log.debug("watch resync on %s failed: %s", self._key, exc)
        self._resume()

    def _resync(self, compacted: int) -> None:
        """Deliver what changed while the history was compacted away, from a fresh read."""
        kvs, revision = self._read()
        present = {kv.key: kv for kv in kvs}
        with self._lock:
            if self._closed:
                return
            log.info(
                "watch on %s: revision %d is compacted (up to %d); re-read at %d",
                self._key, self._next_revision, compacted, revision,
            )  # fmt: skip
            events = [
                WatchEvent("delete", key, b"", value, revision)
                for key, value in self._known.items()
                if key not in present
            ]
            if not self._only_deletes:
                for kv in kvs:
                    before = self._known.get(kv.key)
                    if before != kv.value:
                        events.append(
                            WatchEvent("put", kv.key, kv.value, before or b"", kv.mod_revision,
                                       kv.create_revision)
                        )  # fmt: skip
            if self._only_deletes:
                self._known = {key: value for key, value in self._known.items() if key in present}
            else:
                self._known = {kv.key: kv.value for kv in kvs}
            self._next_revision = revision + 1
        if events:
            self._callback(events)

    def _on_broken(self, error: Exception | None) -> None:
        with self._lock:
            if self._closed or self._etcd.closed:
                return
        log.debug(
            "watch on %s broke (%s); resuming at revision %d", self._key, error, self._next_revision
        )
        threading.Thread(target=self._resume, daemon=True, name="etcd-watch-resume").start()

    def _resume(self) -> None:
        while True:
            with self._lock:
                if self._closed or self._etcd.closed:  # (a closed client's watches end)
                    return
            try:
                self._register()
                return
            except EtcdError as exc:
                log.debug("watch resume on %s failed: %s", self._key, exc)

    def cancel(self) -> None:
        with self._lock:
            self._closed = True
            registered, self._registered = self._registered, None
        if registered is not None:
            registered.cancel()


@dataclass(frozen=True)
class Registration:
    """Where a watch is registered: the stream, its id there, the callback it got."""

    watcher: WatchStream
    watch_id: int
    callback: Callable[[object], None]

    def cancel(self) -> None:
        """End it on its own stream, and only if that id is still this callback's: ids
        count from 0 on every stream, so after its stream ended it is another watch's."""
        with contextlib.suppress(Exception):  # the stream may be gone, with nothing to cancel
            self.watcher.cancel_watch(self.watch_id, self.callback)
