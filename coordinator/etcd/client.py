"""The one thin layer between the product and etcd.

It uses the generated gRPC stubs of `etcd-sdk-python` (`pyetcd`) but does its
own error handling and its own watch stream, because the library: marks an
endpoint dead for minutes after one failure, builds create-revision range
filters wrongly, loses watch events on disconnect, and creates watches one at a
time, each waiting for etcd's answer. Here:

- every call retries transient failures (etcd restarting, a lost connection)
  until `retry_window` has passed, rotating through the endpoints, then raises
  `EtcdUnavailable` naming the endpoints and the cause;
- all of a client's watches share one stream; creating several costs one round
  trip, cancelling costs none, and after a disconnect they resume from the
  last revision they delivered;
- all keys live under a namespace prefix, so deployments can share an etcd.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import grpc
from pyetcd import etcdrpc

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
}


class EtcdError(RuntimeError):
    """etcd refused a request for a reason that retrying will not fix."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered within the retry window; `reason` is the last failure."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class LeaseNotFound(EtcdError):
    """The lease a write was bound to has expired or been revoked."""


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


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """`"h1:2379,h2:2379"` or a list, with or without `http://`, to `["h1:2379", ...]`."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = []
    for item in items:
        item = item.strip().removeprefix("http://").rstrip("/")
        if not item:
            continue
        if item.startswith("https://"):
            raise ValueError(f"etcd endpoint {item!r}: TLS endpoints are not supported yet")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {item!r} is not HOST:PORT")
        parsed.append(item)
    if not parsed:
        raise ValueError("no etcd endpoint given")
    return parsed


def prefix_end(prefix: str) -> bytes:
    """The range end that selects every key starting with `prefix`."""
    raw = bytearray(prefix.encode())
    for i in reversed(range(len(raw))):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes | str
    lease: int = 0

    def request(self) -> etcdrpc.RequestOp:
        put = etcdrpc.PutRequest(key=self.key.encode(), value=_bytes(self.value), lease=self.lease)
        return etcdrpc.RequestOp(request_put=put)


@dataclass(frozen=True)
class Delete:
    key: str

    def request(self) -> etcdrpc.RequestOp:
        return etcdrpc.RequestOp(
            request_delete_range=etcdrpc.DeleteRangeRequest(key=self.key.encode())
        )


@dataclass(frozen=True)
class First:
    """The lowest key in `[start, end)`."""

    start: str
    end: bytes

    def request(self) -> etcdrpc.RequestOp:
        first = etcdrpc.RangeRequest(key=self.start.encode(), range_end=self.end, limit=1)
        return etcdrpc.RequestOp(request_range=first)


@dataclass(frozen=True)
class Get:
    key: str

    def request(self) -> etcdrpc.RequestOp:
        return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=self.key.encode()))


TxnOp = Put | Delete | First | Get


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool  # whether the `when_empty` condition held
    revision: int
    reads: list[KeyValue | None]  # one per `First` or `Get`, in order


def _kv(kv: etcdrpc.KeyValue) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.lease)


class Watch:
    """A watch that survives disconnects by re-watching from its last revision + 1.

    `callback` gets lists of `WatchEvent`s, in revision order, from the client's
    watch thread; it must be quick, must not block, and must not create a watch
    that waits. `start_revision` 0 means "from now": every change after the
    revision `created()` returns reaches the callback.

    With `wait=False` the constructor returns as soon as the create request is
    queued, so several watches cost one round trip: call `created()` on each
    when their registration matters.
    """

    def __init__(
        self,
        etcd: Etcd,
        key: str,
        callback: Callable[[list[WatchEvent]], None],
        start_revision: int,
        prefix: bool = False,
        only_deletes: bool = False,
        wait: bool = True,
    ) -> None:
        self._etcd = etcd
        self.key = key
        self._range_end = prefix_end(key) if prefix else b""
        self._callback = callback
        self._filters = [etcdrpc.WatchCreateRequest.NOPUT] if only_deletes else []
        self._next_revision = start_revision  # the stream's lock guards this and below
        self._id: int | None = None
        self._closed = False
        self._revision = 0  # the revision etcd first registered it at
        self._error: EtcdError | None = None
        self._registered = threading.Event()
        self._stream = etcd._watch_stream()
        self._stream.add(self)
        if wait:
            self.created()

    def created(self, timeout: float | None = None) -> int:
        """Block until etcd has registered the watch; returns the revision it did so at."""
        if timeout is None:
            timeout = self._etcd.retry_window + self._etcd.timeout
        if not self._registered.wait(timeout):
            self.cancel()
            raise EtcdUnavailable(
                f"etcd at {','.join(self._etcd.endpoints)}: no answer to a watch on "
                f"{self.key} within {timeout:g}s",
                "watch creation timed out",
            )
        if self._error is not None:
            raise self._error
        return self._revision

    def _create_request(self) -> etcdrpc.WatchRequest:
        create = etcdrpc.WatchCreateRequest(
            key=self.key.encode(),
            range_end=self._range_end,
            start_revision=self._next_revision,
            filters=self._filters,
            prev_kv=True,
        )
        return etcdrpc.WatchRequest(create_request=create)

    def cancel(self) -> None:
        """Stop delivering events; returns at once (etcd is told without waiting)."""
        self._stream.cancel(self)


class _WatchStream:
    """One bidirectional `Watch` stream per client, carrying all its watches.

    Create requests are pipelined: etcd answers them in order, so the n-th
    `created` answer belongs to the n-th request sent, and nobody waits for one
    before sending the next. Cancels are sent without waiting for the answer;
    events of a cancelled watch that are still in flight are dropped here.
    When the stream breaks, one thread reopens it (rotating endpoints, backing
    off) and re-creates every live watch from its last revision + 1.
    """

    def __init__(self, etcd: Etcd) -> None:
        self._etcd = etcd
        self._lock = threading.Lock()
        self._watches: dict[Watch, None] = {}  # live watches, in creation order
        self._pending: deque[Watch] = deque()  # creates sent on this stream, not yet answered
        self._active: dict[int, Watch] = {}  # etcd's watch id -> watch
        self._requests: queue.SimpleQueue[etcdrpc.WatchRequest | None] | None = None
        self._call: grpc.Future | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="etcd-watch")
        self._thread.start()

    def add(self, watch: Watch) -> None:
        with self._lock:
            if self._stop.is_set():
                raise EtcdError("etcd client is closed")
            self._watches[watch] = None
            if self._requests is not None:
                self._send_create(watch)

    def cancel(self, watch: Watch) -> None:
        with self._lock:
            watch._closed = True
            self._watches.pop(watch, None)
            if watch._id is not None and self._active.get(watch._id) is watch:
                del self._active[watch._id]
                self._send_cancel(watch._id)
            # A create still unanswered is cancelled when its answer comes.

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            if self._requests is not None:
                self._requests.put(None)
            if self._call is not None:
                self._call.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    # -- the stream thread (callers hold the lock) --------------------------

    def _send_create(self, watch: Watch) -> None:
        assert self._requests is not None
        self._pending.append(watch)
        self._etcd.operations += 1
        self._requests.put(watch._create_request())

    def _send_cancel(self, watch_id: int) -> None:
        if self._requests is not None:
            self._etcd.operations += 1
            cancel = etcdrpc.WatchCancelRequest(watch_id=watch_id)
            self._requests.put(etcdrpc.WatchRequest(cancel_request=cancel))

    def _run(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            try:
                channel, stub = self._etcd._watch_stub()
            except EtcdError:
                return  # the client is closed
            requests: queue.SimpleQueue[etcdrpc.WatchRequest | None] = queue.SimpleQueue()
            with self._lock:
                if self._stop.is_set():
                    return
                call = stub.Watch(iter(requests.get, None))
                self._requests, self._call = requests, call
                self._pending.clear()
                self._active.clear()
                for watch in self._watches:
                    self._send_create(watch)
            cause: object = "the stream ended"
            try:
                for response in call:
                    delay = 0.05
                    self._on_response(response)
            except grpc.RpcError as exc:
                cause = exc.details() or exc.code()  # type: ignore[attr-defined]
            with self._lock:
                requests.put(None)  # ends gRPC's request thread
                self._requests, self._call = None, None
            if self._stop.is_set():
                return
            log.debug("etcd watch stream broke (%s); reopening in %.2fs", cause, delay)
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, 1.0)
            self._etcd._rotate(channel)

    def _on_response(self, response: etcdrpc.WatchResponse) -> None:
        with self._lock:
            if response.created:
                self._on_created(response)
                return
            watch = self._active.get(response.watch_id)
            if watch is None:
                return  # a cancelled watch's leftovers, or the answer to a cancel
            if response.compact_revision or response.canceled:
                # etcd dropped it (it fell behind a compaction): start again where it can.
                del self._active[response.watch_id]
                if response.compact_revision:
                    log.warning(
                        "watch on %s lost events before revision %d (compacted)",
                        watch.key,
                        response.compact_revision,
                    )
                    watch._next_revision = response.compact_revision
                self._send_create(watch)
                return
            events = [
                WatchEvent(
                    "delete" if event.type else "put",
                    event.kv.key.decode(),
                    event.kv.value,
                    event.prev_kv.value,
                    event.kv.mod_revision,
                )
                for event in response.events
            ]
            if not events:
                return  # a progress notification
            watch._next_revision = events[-1].revision + 1
        watch._callback(events)

    def _on_created(self, response: etcdrpc.WatchResponse) -> None:
        if not self._pending:
            log.warning("etcd answered a watch creation nobody asked for")
            return
        watch = self._pending.popleft()
        first = not watch._registered.is_set()
        if response.canceled or response.compact_revision:
            self._watches.pop(watch, None)
            watch._closed = True
            reason = response.cancel_reason or f"revision compacted at {response.compact_revision}"
            watch._error = EtcdError(f"etcd refused a watch on {watch.key}: {reason}")
            if not first:
                log.error("watch on %s could not resume: %s", watch.key, reason)
            watch._registered.set()
            return
        watch._id = response.watch_id
        if watch._next_revision == 0:
            watch._next_revision = response.header.revision + 1
        if first:
            watch._revision = response.header.revision
            watch._registered.set()
        if watch._closed:
            self._send_cancel(response.watch_id)
        else:
            self._active[response.watch_id] = watch


class Etcd:
    """A connection to an etcd cluster, with every key under `namespace`."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        namespace: str = "/coordinator",
        timeout: float = 5.0,
        connect_timeout: float = 10.0,
        retry_window: float | None = None,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.namespace = "/" + namespace.strip("/") if namespace.strip("/") else ""
        self.timeout = timeout
        self.retry_window = connect_timeout if retry_window is None else retry_window
        self._lock = threading.Lock()
        self._index = 0
        self._channel: grpc.Channel | None = None
        self._stubs: tuple[etcdrpc.KVStub, etcdrpc.LeaseStub, etcdrpc.WatchStub] | None = None
        self._watches: _WatchStream | None = None
        self._closed = False
        self.operations = 0  # requests sent, for benchmarks
        self._connect(connect_timeout)

    # -- connection -------------------------------------------------------

    def _connect(self, connect_timeout: float) -> None:
        try:
            self._call(
                lambda: self._kv().Range(
                    etcdrpc.RangeRequest(key=b"\0", count_only=True), timeout=self.timeout
                ),
                window=connect_timeout,
            )
        except EtcdUnavailable as exc:
            self.close()
            raise EtcdUnavailable(
                f"cannot reach etcd at {','.join(self.endpoints)} within "
                f"{connect_timeout:g}s: {exc.reason}"
            ) from exc.__cause__

    def _current(self) -> tuple[etcdrpc.KVStub, etcdrpc.LeaseStub, etcdrpc.WatchStub]:
        with self._lock:
            if self._closed:
                raise EtcdError("etcd client is closed")
            if self._stubs is None:
                # A connection of its own: gRPC would otherwise share one between
                # all clients of a process, and members in threads would queue on it.
                self._channel = grpc.insecure_channel(
                    self.endpoints[self._index], options=[("grpc.use_local_subchannel_pool", 1)]
                )
                self._stubs = (
                    etcdrpc.KVStub(self._channel),
                    etcdrpc.LeaseStub(self._channel),
                    etcdrpc.WatchStub(self._channel),
                )
            return self._stubs

    def _kv(self) -> etcdrpc.KVStub:
        return self._current()[0]

    def _lease(self) -> etcdrpc.LeaseStub:
        return self._current()[1]

    def _watch_stub(self) -> tuple[grpc.Channel | None, etcdrpc.WatchStub]:
        stub = self._current()[2]
        with self._lock:
            return self._channel, stub

    def _watch_stream(self) -> _WatchStream:
        with self._lock:
            if self._closed:
                raise EtcdError("etcd client is closed")
            if self._watches is None:
                self._watches = _WatchStream(self)
            return self._watches

    def _rotate(self, failed: grpc.Channel | None = None) -> None:
        """Move to the next endpoint; with one endpoint gRPC reconnects by itself.

        With `failed`, only if that channel is still the current one (the watch
        stream's failure must not undo a rotation a request already made).
        """
        if len(self.endpoints) == 1:
            return
        with self._lock:
            if failed is not None and failed is not self._channel:
                return
            self._index = (self._index + 1) % len(self.endpoints)
            old_channel = self._channel
            self._channel, self._stubs = None, None
        if old_channel is not None:
            old_channel.close()  # the watch stream breaks, and reopens on the next endpoint

    def _call(self, request: Callable[[], T], window: float | None = None) -> T:
        """Send one request, retrying transient failures for `window` seconds."""
        deadline = time.monotonic() + (self.retry_window if window is None else window)
        delay = 0.05
        while True:
            self.operations += 1
            try:
                return request()
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""  # type: ignore[attr-defined]
                if "requested lease not found" in details:
                    raise LeaseNotFound(details) from exc
                if code not in _TRANSIENT:
                    raise EtcdError(f"etcd refused the request: {code.name}: {details}") from exc
                if time.monotonic() + delay > deadline:
                    raise EtcdUnavailable(
                        f"etcd at {','.join(self.endpoints)}: {details}", details
                    ) from exc
            self._rotate()
            time.sleep(delay)  # back-off between retries of a failed request
            delay = min(delay * 2, 1.0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channel, watches = self._channel, self._watches
            self._channel, self._stubs, self._watches = None, None, None
        if watches is not None:
            watches.close()
        if channel is not None:
            channel.close()

    def __enter__(self) -> Etcd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys -------------------------------------------------------------

    def key(self, *parts: str | int) -> str:
        """A key under the namespace: `key("jobs", "j1")` -> `/coordinator/jobs/j1`."""
        return "/".join([self.namespace, *map(str, parts)])

    def get(self, key: str) -> KeyValue | None:
        response = self._call(
            lambda: self._kv().Range(etcdrpc.RangeRequest(key=key.encode()), timeout=self.timeout)
        )
        return _kv(response.kvs[0]) if response.kvs else None

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under `prefix`, sorted by key, and the revision they were read at."""
        request = etcdrpc.RangeRequest(key=prefix.encode(), range_end=prefix_end(prefix))
        response = self._call(lambda: self._kv().Range(request, timeout=self.timeout))
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
        response = self._call(lambda: self._kv().Range(request, timeout=self.timeout))
        return response.count if max_create_revision == 0 else len(response.kvs)

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Write a key; returns the revision of the write."""
        request = etcdrpc.PutRequest(key=key.encode(), value=_bytes(value), lease=lease)
        return self._call(lambda: self._kv().Put(request, timeout=self.timeout)).header.revision

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
        response = self._call(lambda: self._kv().Txn(request, timeout=self.timeout))
        ranges = [r.response_range for r in response.responses if r.HasField("response_range")]
        current = _kv(ranges[0].kvs[0])
        count = ranges[1].count if count_prefix else 0
        mine = current.value == raw and current.lease == lease
        return response.succeeded or mine, current, count

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
        response = self._call(lambda: self._kv().Txn(request, timeout=self.timeout))
        return response.header.revision, response.responses[1].response_range.count

    def transaction(
        self,
        ops: Sequence[TxnOp],
        *,
        when_empty: Sequence[tuple[str, bytes]] = (),
        otherwise: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """Run `ops` if every key range in `when_empty` holds no key, else `otherwise`.

        Ranges are `(start, end)` with `end` exclusive (bytes). A `First` op reads
        the lowest key of its range, a `Get` one key; the result lists one answer
        per read, in order, for the branch that ran. One request, atomic.
        """
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
        request = etcdrpc.TxnRequest(
            compare=compare,
            success=[op.request() for op in ops],
            failure=[op.request() for op in otherwise],
        )
        response = self._call(lambda: self._kv().Txn(request, timeout=self.timeout))
        reads = [
            _kv(r.response_range.kvs[0]) if r.response_range.kvs else None
            for r in response.responses
            if r.HasField("response_range")
        ]
        return TxnResult(response.succeeded, response.header.revision, reads)

    def delete(self, key: str) -> int:
        request = etcdrpc.DeleteRangeRequest(key=key.encode())
        return self._call(lambda: self._kv().DeleteRange(request, timeout=self.timeout)).deleted

    def delete_prefix(self, prefix: str) -> int:
        request = etcdrpc.DeleteRangeRequest(key=prefix.encode(), range_end=prefix_end(prefix))
        return self._call(lambda: self._kv().DeleteRange(request, timeout=self.timeout)).deleted

    # -- leases -----------------------------------------------------------

    def grant_lease(self, ttl: int) -> int:
        request = etcdrpc.LeaseGrantRequest(TTL=ttl)
        response = self._call(lambda: self._lease().LeaseGrant(request, timeout=self.timeout))
        if response.error:
            raise EtcdError(f"etcd refused a lease of {ttl}s: {response.error}")
        return response.ID

    def keepalive(self, lease_id: int) -> int:
        """Renew a lease once; returns its remaining TTL (0 when it is gone). No retries."""
        requests = iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)])
        self.operations += 1
        call = self._lease().LeaseKeepAlive(requests, timeout=self.timeout)
        try:
            return next(call).TTL
        except StopIteration:
            return 0
        finally:
            call.cancel()  # one answer is all we need; an open stream would pile up

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease, deleting every key bound to it. An unknown lease is fine."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        with contextlib.suppress(LeaseNotFound):
            self._call(lambda: self._lease().LeaseRevoke(request, timeout=self.timeout))

    # -- watches ----------------------------------------------------------

    def watch(
        self,
        key: str,
        callback: Callable[[list[WatchEvent]], None],
        start_revision: int,
        prefix: bool = False,
        only_deletes: bool = False,
        wait: bool = True,
    ) -> Watch:
        """Deliver changes of `key` (or every key under it) from `start_revision` on.

        `start_revision` 0 is "from now" (see `Watch.created`); with `wait=False`
        it returns before etcd has answered (see `Watch`).
        """
        return Watch(
            self, key, callback, start_revision, prefix=prefix, only_deletes=only_deletes, wait=wait
        )


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
