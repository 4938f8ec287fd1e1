"""Each member's communication endpoint, and the leader's check that it is reachable.

This replaces the seed's `ssh` phase: instead of waiting for an ssh daemon,
every member listens on a TCP port at its advertised address, and a caller and
the member prove to each other that they hold the round's secret (`handshake`),
so the leader knows it reaches the right process at the published address (not
a stale container that reused the IP, nor a stranger), and the member knows the
caller is one of the job's.

Every accepted connection is bounded: the handshake must end within
`handshake_timeout`, a connection idle for `idle_timeout` is dropped, and past
`max_connections` at once a new one is closed at once, before any byte is read.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

from coordinator.rendezvous import handshake
from coordinator.rendezvous.handshake import HandshakeError, HandshakeKey

Handler = Callable[[socket.socket], None]

HANDSHAKE_TIMEOUT = 5.0
IDLE_TIMEOUT = 300.0
MAX_CONNECTIONS = 64


class MemberEndpoint:
    """A listening socket on `bind_host:port` (0: any free port) that admits only callers
    that prove the round's secret (known once `authorize` is called).

    A job can `serve` on it (a parameter server does): after the handshake the
    connection goes to the handler, in a thread of its own, instead of being
    closed. A caller that only wanted the handshake closes; the handler sees that
    at once. The handler's socket has the idle timeout set.
    """

    def __init__(
        self,
        job_id: str,
        member_id: str,
        bind_host: str,
        port: int = 0,
        *,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        idle_timeout: float = IDLE_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.job_id, self.member_id = job_id, member_id
        self.handshake_timeout, self.idle_timeout = handshake_timeout, idle_timeout
        self.max_connections = max_connections
        self.handler: Handler | None = None
        self._key: HandshakeKey | None = None
        self._authorized = threading.Condition()
        self._active = 0  # connections accepted and not yet closed
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        # Every member probes the leader at once: a short backlog would drop their
        # connections, and each dropped one waits a second for its SYN to be resent.
        backlog = max(128, min(max_connections, 4096))
        self._sock = socket.create_server((bind_host, port), family=family, backlog=backlog)
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="member-endpoint")
        self._thread.start()

    @property
    def active(self) -> int:
        """Connections open right now (in the handshake or with the handler)."""
        with self._authorized:
            return self._active

    def authorize(self, secret: bytes, round_: int) -> None:
        """From now on admit callers proving `secret` for this job, round and member."""
        key = handshake.key_for(secret, self.job_id, round_, self.member_id)
        with self._authorized:
            self._key = key
            self._authorized.notify_all()

    def _key_by(self, deadline: float) -> HandshakeKey | None:
        with self._authorized:
            self._authorized.wait_for(
                lambda: self._key is not None or self._closed, deadline - time.monotonic()
            )
            return None if self._closed else self._key

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._authorized:
                admitted = self._active < self.max_connections
                self._active += admitted
            if not admitted:  # over the cap: closed at once, nothing read or said
                _close(conn)
                continue
            threading.Thread(
                target=self._admit, args=(conn,), daemon=True, name="member-channel"
            ).start()

    def _admit(self, conn: socket.socket) -> None:
        try:
            if not handshake.answer(conn, self._key_by, self.handshake_timeout):
                return
            handler = self.handler
            if handler is not None:
                conn.settimeout(self.idle_timeout)
                handler(conn)
        finally:
            _close_gracefully(conn)
            with self._authorized:
                self._active -= 1

    def close(self) -> None:
        with self._authorized:
            self._closed = True
            self._authorized.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _close(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.close()


LINGER_SECONDS, LINGER_BYTES = 0.5, 1 << 16


def _close_gracefully(conn: socket.socket) -> None:
    """Say we are done, and drop what the peer still sends (a little, briefly) before
    closing: closing with unread bytes would reset the connection, and the peer could
    lose the last thing said to it (a refusal, an error)."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + LINGER_SECONDS
        dropped = 0
        while dropped < LINGER_BYTES and (remaining := deadline - time.monotonic()) > 0:
            conn.settimeout(remaining)
            chunk = conn.recv(LINGER_BYTES)
            if not chunk:
                break
            dropped += len(chunk)
    _close(conn)


def open_channel(host: str, port: int, key: HandshakeKey, timeout: float) -> socket.socket:
    """A connection to a member's endpoint, after the handshake: the socket then belongs
    to the job's protocol (a trainer's link to a parameter server)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        handshake.offer(sock, key, timeout)
    except HandshakeError as exc:
        sock.close()
        raise HandshakeError(f"{host}:{port}: {exc}") from None
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def probe(
    host: str,
    port: int,
    key: HandshakeKey,
    deadline: float,
    give_up: Callable[[], bool] = lambda: False,
) -> str | None:
    """Connect until the member completes the handshake; None on success, else why not.

    `give_up` ends the retries early (a member is already known to be lost).
    """
    problem = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        try:
            timeout = max(0.1, min(remaining, 2.0))
            with socket.create_connection((host, port), timeout=timeout) as sock:
                handshake.offer(sock, key, timeout)
            return None
        except OSError as exc:  # HandshakeError included: it may be a stale process
            problem = str(exc)
        if time.monotonic() + 0.2 > deadline or give_up():
            return problem
        time.sleep(0.2)  # retry a refused connection: the member may still be starting
