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


class MemberEndpoint:
    """A listening socket on `bind_host:port` (0: any free port) that greets callers."""

    def __init__(self, job_id: str, member_id: str, bind_host: str, port: int = 0) -> None:
        self._greeting = _greeting(job_id, member_id)
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
            with conn, contextlib.suppress(OSError):
                conn.sendall(self._greeting)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


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
