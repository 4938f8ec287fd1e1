"""Each member's communication endpoint, and the leader's check that it is reachable.

This replaces the seed's `ssh` phase: instead of waiting for an ssh daemon,
every member listens on a TCP port and answers a connection with a line that
names its job and rank, so the leader can prove it reaches the right process
at the published address (not a stale container that reused the IP).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable


def _greeting(job_id: str, member_id: str) -> bytes:
    return f"coordinator {job_id} {member_id}\n".encode()


Handler = Callable[[socket.socket], None]


class MemberEndpoint:
    """A listening socket on `bind_host:port` (0: any free port) that greets callers.

    A job can `serve` on it (a parameter server does): after the greeting the
    connection goes to the handler, in a thread of its own, instead of being closed.
    A caller that only wanted the greeting closes; the handler sees that at once.
    """

    def __init__(self, job_id: str, member_id: str, bind_host: str, port: int = 0) -> None:
        self._greeting = _greeting(job_id, member_id)
        self.handler: Handler | None = None
        self._sock = socket.create_server((bind_host, port), backlog=128)
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="member-endpoint")
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            handler = self.handler
            try:
                conn.sendall(self._greeting)
            except OSError:
                conn.close()
                continue
            if handler is None:
                conn.close()
            else:
                threading.Thread(
                    target=_handle, args=(handler, conn), daemon=True, name="member-channel"
                ).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def _handle(handler: Handler, conn: socket.socket) -> None:
    with conn:
        handler(conn)


def open_channel(
    host: str, port: int, job_id: str, member_id: str, timeout: float
) -> socket.socket:
    """A connection to a member's endpoint, after checking its greeting: the socket then
    belongs to the job's protocol (a trainer's link to a parameter server)."""
    expected = _greeting(job_id, member_id)
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        received = b""
        while not received.endswith(b"\n") and len(received) < len(expected):
            chunk = sock.recv(len(expected) - len(received))
            if not chunk:
                break
            received += chunk
        if received != expected:
            raise ConnectionError(
                f"{host}:{port} answered {received[:80]!r}, expected {expected!r}"
            )
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


def probe(
    host: str,
    port: int,
    job_id: str,
    member_id: str,
    deadline: float,
    give_up: Callable[[], bool] = lambda: False,
) -> str | None:
    """Connect until the member answers with its greeting; None on success, else why not.

    `give_up` ends the retries early (a member is already known to be lost).
    """
    expected = _greeting(job_id, member_id)
    problem = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection(
                (host, port), timeout=max(0.1, min(remaining, 2.0))
            ) as sock:
                received = b""
                while not received.endswith(b"\n") and len(received) < 512:
                    chunk = sock.recv(512)
                    if not chunk:
                        break
                    received += chunk
            if received == expected:
                return None
            problem = f"answered {received[:80]!r}, expected {expected!r}"
        except OSError as exc:
            problem = str(exc)
        if time.monotonic() + 0.2 > deadline or give_up():
            return problem
        time.sleep(0.2)  # retry a refused connection: the member may still be starting
