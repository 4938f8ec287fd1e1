"""The member's etcd proxy for its program: a gRPC server on a unix socket that
forwards, with the member's credentials, only what `coordinator.etcd.scope` allows.

The program gets `COORDINATOR_ETCD=unix:<socket>` and no etcd credentials, so
etcd's calls that skip key permissions (alarms, compaction, other leases) are out
of its reach. The socket is 0600 in the member's 0700 private folder: only the
member's user reaches it, and it grants no more than the program already has.

Requests are parsed (to be judged) and answers passed on as bytes, unparsed. A
refused call gets PERMISSION_DENIED saying why; etcd's own errors pass on with
their code and text, so the program's client reacts to them as to etcd's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from pyetcd import etcdrpc

from coordinator.etcd.connection import REQUIRE_LEADER, UNIX, Connection
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.scope import LEASE, STREAMS, UNARY, Scope

log = logging.getLogger(__name__)

#: Leases a program may hold through its proxy at once; more is refused.
MAX_LEASES = 256
#: Calls in progress at once (a watch stream is one for its life); more are refused.
MAX_CALLS = 64
#: Threads serving calls: a program's client has one watch stream and few calls at once.
WORKERS = 16
#: How long closing spends revoking the leases granted here, at most.
REVOKE_SECONDS = 2.0
#: A unix socket's path must fit in sockaddr_un (108 bytes, with its NUL).
MAX_SOCKET_PATH = 100


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()  # type: ignore[no-any-return]


class EtcdProxy:
    """Serves one program's etcd calls at `endpoint` until `close`."""

    def __init__(self, etcd: Connection, scope: Scope, socket_path: Path) -> None:
        if len(str(socket_path)) > MAX_SOCKET_PATH:
            raise ValueError(f"proxy socket path {socket_path} is longer than {MAX_SOCKET_PATH}")
        self.etcd, self.scope, self.socket_path = etcd, scope, socket_path
        self._lock = threading.Lock()  # over scope.granted
        self.refused = 0  # calls refused, for tests and logs
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="etcd-proxy"),
            handlers=[_Handler(self)],
            maximum_concurrent_rpcs=MAX_CALLS,
            options=[
                # The program's client pings every PING_SECONDS, even when idle.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 4000),
                ("grpc.http2.max_ping_strikes", 0),
            ],
        )
        old = os.umask(0o177)  # the socket is made 0600 (its folder is 0700 besides)
        try:
            self._server.add_insecure_port(f"{UNIX}{socket_path}")
        finally:
            os.umask(old)
        os.chmod(socket_path, 0o600)

    @property
    def endpoint(self) -> str:
        """What the program gets as COORDINATOR_ETCD."""
        return f"{UNIX}{self.socket_path}"

    def start(self) -> EtcdProxy:
        self._server.start()
        return self

    def close(self) -> None:
        """Stop serving (calls in progress end), then revoke the leases granted here."""
        self._server.stop(grace=None).wait(5.0)  # (streams are cancelled at once)
        with self._lock:
            granted, self.scope.granted = set(self.scope.granted), set()
        deadline = time.monotonic() + REVOKE_SECONDS  # (the rest end with their TTL)
        for lease in granted:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            request = etcdrpc.LeaseRevokeRequest(ID=lease)
            with contextlib.suppress(EtcdError):
                self.etcd.forward(LEASE + "LeaseRevoke", request, window=min(left, 1.0))
        with contextlib.suppress(OSError):
            self.socket_path.unlink()

    def __enter__(self) -> EtcdProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls -------------------------------------------------------------

    def judge(self, method: str, request: Any, context: grpc.ServicerContext) -> None:
        """Abort the call (PERMISSION_DENIED, saying why) unless the scope allows it."""
        with self._lock:
            problem = self.scope.refusal(method, request)
            full = len(self.scope.granted) >= MAX_LEASES
            if problem is None and method == LEASE + "LeaseGrant" and full:
                problem = f"a program holds at most {MAX_LEASES} leases"
        if problem is not None:
            self.refused += 1
            log.info("refused a program's %s: %s", method, problem)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"coordinator proxy: {problem}")

    def refuse(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        """A method the scope never allows (Maintenance, Cluster, Auth, Compact, ...)."""
        self.judge(method, request, context)
        raise AssertionError("unreachable: the scope allows no other method")

    def unary(self, method: str, request: Any, context: grpc.ServicerContext) -> bytes:
        self.judge(method, request, context)
        # Within the program's own deadline, retried as the member retries its own calls.
        remaining = context.time_remaining()
        window = self.etcd.retry_window if remaining is None else remaining
        try:
            answer = self.etcd.forward(
                method, request, max(0.05, min(window, self.etcd.retry_window))
            )
        except EtcdError as exc:
            _abort_like(context, exc)
        if method == LEASE + "LeaseGrant":
            granted = etcdrpc.LeaseGrantResponse.FromString(answer)
            if granted.ID and not granted.error:
                with self._lock:
                    self.scope.granted.add(granted.ID)
        elif method == LEASE + "LeaseRevoke":
            with self._lock:
                self.scope.granted.discard(request.ID)
        return answer

    def stream(
        self, method: str, requests: Iterator[Any], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        """Forward a stream both ways; a refused request ends it with PERMISSION_DENIED."""
        refused: list[str] = []
        upstream: list[grpc.Future] = []

        def checked() -> Iterator[Any]:
            for request in requests:
                with self._lock:
                    problem = self.scope.refusal(method, request)
                if problem is not None:
                    refused.append(problem)
                    if upstream:
                        upstream[0].cancel()
                    return
                yield request

        remaining = context.time_remaining()
        timeout = None if remaining is None or remaining > 1e6 else remaining
        call = self.etcd.calls_channel().stream_stream(
            method, request_serializer=_serialize, response_deserializer=None
        )(checked(), timeout=timeout, metadata=REQUIRE_LEADER)
        upstream.append(call)
        if refused:  # refused before `upstream` held the call: `checked` could not cancel it
            call.cancel()
        context.add_callback(call.cancel)
        try:
            yield from call
        except grpc.RpcError as exc:
            if refused:
                self.refused += 1
                log.info("refused a program's %s: %s", method, refused[0])
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"coordinator proxy: {refused[0]}")
            context.abort(exc.code(), exc.details() or "")  # type: ignore[attr-defined]
        if refused:
            self.refused += 1
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"coordinator proxy: {refused[0]}")


def _abort_like(context: grpc.ServicerContext, exc: EtcdError) -> Any:
    """End the call as etcd ended it (its code and text), or UNAVAILABLE."""
    cause = exc.__cause__
    if isinstance(cause, grpc.RpcError):
        context.abort(cause.code(), cause.details() or "")  # type: ignore[attr-defined]
    context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


class _Handler(grpc.GenericRpcHandler):
    """Routes every method: allowed ones to the proxy, the rest to a refusal."""

    def __init__(self, proxy: EtcdProxy) -> None:
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        for method, message in UNARY.items():
            self._handlers[method] = grpc.unary_unary_rpc_method_handler(
                _bind(proxy.unary, method),
                request_deserializer=message.FromString,
                response_serializer=None,
            )
        for method, message in STREAMS.items():
            self._handlers[method] = grpc.stream_stream_rpc_method_handler(
                _bind(proxy.stream, method),
                request_deserializer=message.FromString,
                response_serializer=None,
            )
        self._proxy = proxy

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method  # type: ignore[attr-defined]
        found = self._handlers.get(method)
        if found is not None:
            return found
        # (Read as one request, whatever the method's kind: the call ends refused at once.)
        return grpc.unary_unary_rpc_method_handler(
            _bind(self._proxy.refuse, method), request_deserializer=None, response_serializer=None
        )


def _bind(function: Callable[..., Any], method: str) -> Callable[..., Any]:
    return lambda request, context: function(method, request, context)
