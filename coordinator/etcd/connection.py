"""How a request reaches etcd, and what happens when it does not.

It uses the generated gRPC stubs and the watch stream of `etcd-sdk-python`
(`pyetcd`) but does its own error handling, because the library's marks an
endpoint dead for minutes after one failure. Here:

- every call retries transient failures (etcd restarting, a lost connection)
  until `retry_window` has passed, rotating through the endpoints, then raises
  `EtcdUnavailable` naming the endpoints and the cause;
- in a cluster, an attempt stuck on a member whose leader died (its proposal was
  forwarded to a dead leader, and etcd never answers it) ends after
  `attempt_timeout`, and every request asks for a member with a leader, so a
  request succeeds within a second of an election;
- a connection left behind is closed only once no call can still start on it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from pyetcd import etcdrpc

from coordinator.etcd.errors import EtcdError, EtcdRefused, EtcdUnavailable, LeaseNotFound, refusal
from coordinator.etcd.security import EtcdSecurity, SecurityError, TokenAuth, token_rejected
from coordinator.etcd.stream import WatchStream
from coordinator.etcd.watchdog import Watchdog

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
#: How long closing waits for the watch stream's thread to end. It ends as soon as it is
#: scheduled; but a process whose interpreter shuts down while that thread still reads
#: the cancelled stream can hang for ever in gRPC's `__del__` (the frozen thread holds the
#: call's lock). 0.25 s was too little on a loaded machine: a program never exited.
CLOSE_JOIN_SECONDS = 5.0

#: The shortest attempt of a request whose retry window is nearly over.
MIN_ATTEMPT = 0.1
#: Attempts of a request that run out of `attempt_timeout` before its deadline grows.
SHORT_ATTEMPTS = 3

#: How an endpoint that is a unix socket (a member's proxy for its program) starts.
UNIX = "unix:"

#: What each attempt of a request is sent with: its deadline and REQUIRE_LEADER.
CallOptions = dict[str, Any]


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """`"h1:2379,h2:2379"` or a list, with or without `http://`, to `["h1:2379", ...]`.

    `https://HOST:PORT` endpoints (TLS) keep their scheme, so the endpoints can be
    handed on to members as they are; TLS and plain endpoints cannot be mixed.
    """
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    unix = [item.strip() for item in items if item.strip().startswith(UNIX)]
    if unix:  # a member's proxy (coordinator.etcd.proxy): one socket, nothing else
        path = unix[0].removeprefix(UNIX)
        if len(items) > 1 or not path.startswith("/"):
            raise ValueError(f"etcd endpoint {unix[0]!r}: a unix: endpoint is one absolute path")
        return [unix[0]]
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


class Connection:
    """One gRPC connection at a time to a member of the cluster, moved to the next
    member when a request fails there; `Etcd` is what the product asks over it."""

    def __init__(
        self,
        parsed: list[str],
        *,
        security: EtcdSecurity,
        probe_prefix: str,
        timeout: float,
        attempt_timeout: float,
        retry_window: float,
        ping_interval: float,
    ) -> None:
        """`parsed`: the endpoints as `parse_endpoints` gives them. `probe_prefix`: what this client
        must be allowed to read and write (named when etcd refuses it)."""
        self.security = security
        self.security.check_endpoints(parsed)
        self.secure = parsed[0].startswith("https://")
        # Bare HOST:PORT, as address lookups want them; `urls` gives them to members.
        self.endpoints = [e.removeprefix("https://") for e in parsed]
        self.probe_prefix = probe_prefix
        self.timeout = timeout
        self.attempt_timeout = min(attempt_timeout, timeout)
        self.retry_window = retry_window
        self.ping_interval = ping_interval
        self._credentials = self._tls_credentials() if self.secure else None
        self._auth = TokenAuth(self.security, timeout) if self.security.authenticates else None
        self._lock = threading.Lock()
        self._watch_lock = threading.Lock()  # see Watch._register
        # Clients start at a random member, so a job's members spread over the cluster.
        self._index = random.randrange(len(self.endpoints))
        self._generation = 0  # of the connection: bumped at every move to another endpoint
        self._channel: grpc.Channel | None = None
        self._stubs: (
            tuple[etcdrpc.KVStub, etcdrpc.LeaseStub, WatchStream, etcdrpc.AuthStub] | None
        ) = None
        self._calls_channel: grpc.Channel | None = None  # what every stub calls through
        self._forwarders: dict[str, Any] = {}  # `forward`'s callables, "" their channel
        self._closed = False
        self.operations = 0  # requests sent, for benchmarks
        self.watchdog = Watchdog()  # which attempts outlived their deadlines

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

    def _current(self) -> tuple[etcdrpc.KVStub, etcdrpc.LeaseStub, WatchStream, etcdrpc.AuthStub]:
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
                self._calls_channel = channel
                self._stubs = (
                    etcdrpc.KVStub(channel),
                    etcdrpc.LeaseStub(channel),
                    WatchStream(
                        etcdrpc.WatchStub(channel), timeout=self.timeout, metadata=REQUIRE_LEADER
                    ),
                    etcdrpc.AuthStub(channel),
                )
            return self._stubs

    def _kv(self) -> etcdrpc.KVStub:
        return self._current()[0]

    def _lease(self) -> etcdrpc.LeaseStub:
        return self._current()[1]

    def _watcher(self) -> WatchStream:
        return self._current()[2]

    def calls_channel(self) -> grpc.Channel:
        """The channel calls go through now (with this client's token), for the proxy
        that forwards a program's calls (`coordinator.etcd.proxy`)."""
        self._current()
        with self._lock:
            assert self._calls_channel is not None
            return self._calls_channel

    def forward(self, method: str, request: Any, window: float) -> bytes:
        """One unary call of etcd's API by its full gRPC name, sent as this client with
        its retries for at most `window` seconds; the answer's bytes, unparsed. For the
        program proxy, which has judged the call already (`coordinator.etcd.scope`)."""

        def send(options: CallOptions) -> bytes:
            channel = self.calls_channel()
            callables = self._forwarders
            if callables.get("") is not channel:  # (made once per connection and method)
                callables = self._forwarders = {"": channel}
            call = callables.get(method)
            if call is None:
                call = callables[method] = channel.unary_unary(
                    method, request_serializer=_serialize, response_deserializer=None
                )
            return call(request, **options)  # type: ignore[no-any-return]

        return self._call(send, window=window)

    def auth_api(self, method: str, request: Any) -> Any:
        """One call of etcd's Auth service (`UserAdd`, `RoleGrantPermission`, ...) with this
        client's token and retries; what it may do is up to etcd (users and roles: the
        root role only). A refusal raises EtcdError, its cause the grpc.RpcError."""
        return self._call(lambda o: getattr(self._current()[3], method)(request, **o))

    def maintenance_api(self, method: str, request: Any) -> Any:
        """One call of etcd's Maintenance service (`Alarm`, `Status`) with retries."""

        def call(options: CallOptions) -> Any:
            self._current()
            channel = self._calls_channel
            if channel is None:  # (another thread moved on meanwhile: retried)
                raise ValueError("connection closed")
            stub = etcdrpc.MaintenanceStub(channel)
            return getattr(stub, method)(request, **options)

        return self._call(call)

    def auth_enabled(self) -> bool:
        """Whether etcd asks for credentials (known by authenticating; without a user this
        client could only have connected to an etcd that does not)."""
        if self._auth is None:
            return False
        auth = self._auth
        return bool(self._call(lambda o: (self._current(), auth.token(o["timeout"]))[1]))

    def _renew_watcher(self, stale: WatchStream) -> None:
        """A new watch stream in place of one where a watch's creation timed out: the
        library pairs creations with etcd's answers by order, so that creation's late
        answer would be taken for the next one's (which then gets another watch's events
        and never its own). The old stream's watches resume on the new one."""
        with self._lock:
            if self._stubs is None or self._stubs[2] is not stale:
                return
            kv, lease, _, auth = self._stubs
            fresh = WatchStream(stale.stub, timeout=self.timeout, metadata=stale.metadata)
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
                with self.watchdog.call("request", timeout):
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
                refused = refusal(
                    code,
                    details,
                    urls=self.urls,
                    security=self.security,
                    authenticates=self._auth is not None,
                    probe_prefix=self.probe_prefix,
                )
                if refused is not None:
                    raise refused from exc
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

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channel, stubs = self._channel, self._stubs
            self._channel, self._stubs = None, None
        if stubs is not None:
            stubs[2].close()
            stubs[2].join(CLOSE_JOIN_SECONDS)
        if channel is not None:
            _retire(channel)


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()  # type: ignore[no-any-return]


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
