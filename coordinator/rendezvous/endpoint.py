"""Each member's communication endpoint, and the leader's check that it is reachable.

This replaces the seed's `ssh` phase: instead of waiting for an ssh daemon,
every member listens on a TCP port at its advertised address, and a caller and
the member prove to each other that they hold the round's secret (`handshake`),
so the leader knows it reaches the right process at the published address (not
a stale container that reused the IP, nor a stranger), and the member knows the
caller is one of the job's.

Every accepted connection is bounded. Until the caller's proof arrives it is a pending
handshake, held by one thread for all (a selector): it must say something within 2 s
and finish within `handshake_timeout`, and pending ones are counted apart from
channels, with a cap per source address (`admission`): a flood of idle connections
churns its own, never the real callers'. A proven caller gets a channel, a thread of
its own, up to `max_connections` at once (past them, it is closed unanswered); a
channel idle for `idle_timeout` is dropped.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.rendezvous import handshake
from coordinator.rendezvous.admission import Admission
from coordinator.rendezvous.handshake import HandshakeError, HandshakeKey

Handler = Callable[[socket.socket], None]

HANDSHAKE_TIMEOUT = 5.0
IDLE_TIMEOUT = 300.0
MAX_CONNECTIONS = 64
ACCEPTS_PER_TURN = 32  # connections accepted between two looks at the pending ones


@dataclass
class _Pending:
    """A connection whose caller has not proven the secret yet."""

    id: int
    conn: socket.socket
    nonce: bytes
    received: bytearray = field(default_factory=bytearray)


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
        self._authorized = threading.Condition()  # also guards `_books`
        self._books = Admission(max_connections, handshake_timeout)
        self._ids = itertools.count()
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        # Every member probes the leader at once: a short backlog would drop their
        # connections, and each dropped one waits a second for its SYN to be resent.
        backlog = max(128, min(max_connections, 4096))
        self._sock = socket.create_server((bind_host, port), family=family, backlog=backlog)
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="member-endpoint")
        self._thread.start()

    @property
    def active(self) -> int:
        """Connections open right now (pending handshakes and channels)."""
        with self._authorized:
            return self._books.pending + self._books.channels

    @property
    def pending(self) -> int:
        """Connections whose caller has not proven the secret (yet)."""
        with self._authorized:
            return self._books.pending

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
        """Accept, send each newcomer its challenge and read the callers' proofs, all in
        this one thread; a proof read goes to a channel thread (`_finish`)."""
        selector = selectors.DefaultSelector()
        selector.register(self._sock, selectors.EVENT_READ)
        pending: dict[int, _Pending] = {}
        try:
            while not self._closed:
                with self._authorized:
                    due = self._books.next_deadline()
                wait = 1.0 if due is None else min(1.0, max(0.0, due - time.monotonic()))
                ready = selector.select(wait)
                for key, _ in ready:  # the proofs first: a newcomer never delays them
                    if key.data is not None:
                        self._hear(selector, pending, key.data)
                if any(key.data is None for key, _ in ready) and not self._accept(
                    selector, pending
                ):
                    return
                with self._authorized:
                    late = self._books.expired(time.monotonic())
                for conn_id in late:  # silent, or unfinished: told only "refused"
                    with contextlib.suppress(OSError):
                        pending[conn_id].conn.send(handshake.REFUSED)
                    self._drop(selector, pending, conn_id)
        finally:
            for conn_id in list(pending):
                self._drop(selector, pending, conn_id)
            selector.close()

    def _accept(self, selector: selectors.BaseSelector, pending: dict[int, _Pending]) -> bool:
        """Take up to `ACCEPTS_PER_TURN` newcomers; False once the socket is closed."""
        for _ in range(ACCEPTS_PER_TURN):
            try:
                conn, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            conn_id = next(self._ids)
            with self._authorized:
                dropped = self._books.arrive(conn_id, address[0], time.monotonic())
            for old in dropped:  # the oldest pending ones make room: closed, nothing said
                self._drop(selector, pending, old, forget=False)
            entry = _Pending(conn_id, conn, secrets.token_bytes(handshake.NONCE_BYTES))
            try:
                conn.setblocking(False)
                sent = conn.send(handshake.challenge(entry.nonce))  # fits any fresh buffer
            except OSError:
                sent = 0
            pending[conn_id] = entry
            if sent != handshake.CHALLENGE_SIZE:
                self._drop(selector, pending, conn_id)
                continue
            selector.register(conn, selectors.EVENT_READ, conn_id)
        return True

    def _hear(
        self, selector: selectors.BaseSelector, pending: dict[int, _Pending], conn_id: int
    ) -> None:
        entry = pending.get(conn_id)
        if entry is None:
            return
        try:
            chunk = entry.conn.recv(handshake.RESPONSE_SIZE - len(entry.received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the caller stopped short: told only "refused"
            with contextlib.suppress(OSError):
                entry.conn.send(handshake.REFUSED)
            self._drop(selector, pending, conn_id)
            return
        entry.received += chunk
        with self._authorized:
            self._books.heard(conn_id)
            if len(entry.received) < handshake.RESPONSE_SIZE:
                return
            deadline = self._books.deadline(conn_id)
            self._books.leave(conn_id)
            channel = self._books.open_channel()
        selector.unregister(entry.conn)
        del pending[conn_id]
        if not channel:  # every channel taken: closed unanswered
            _close(entry.conn)
            return
        try:
            threading.Thread(
                target=self._finish, args=(entry, deadline), daemon=True, name="member-channel"
            ).start()
        except RuntimeError:  # no thread to be had (the host's limit): this caller only
            _close(entry.conn)
            with self._authorized:
                self._books.close_channel()

    def _drop(
        self,
        selector: selectors.BaseSelector,
        pending: dict[int, _Pending],
        conn_id: int,
        forget: bool = True,
    ) -> None:
        entry = pending.pop(conn_id, None)
        if forget:
            with self._authorized:
                self._books.leave(conn_id)
        if entry is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(entry.conn)
        _close(entry.conn)

    def _finish(self, entry: _Pending, deadline: float) -> None:
        conn = entry.conn
        try:
            conn.setblocking(True)
            if not handshake.finish(
                conn, self._key_by, entry.nonce, bytes(entry.received), deadline
            ):
                return
            handler = self.handler
            if handler is not None:
                conn.settimeout(self.idle_timeout)
                handler(conn)
        finally:
            _close_gracefully(conn)
            with self._authorized:
                self._books.close_channel()

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
