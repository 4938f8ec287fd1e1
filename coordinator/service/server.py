"""uvicorn as the service runs it: bounded, with timeouts, and quick to stop.

- at most `MAX_CONNECTIONS` connections and requests at once (beyond: 503);
- a connection must finish its request's headers within `HEADER_TIMEOUT_SECONDS`
  (slow senders do not hold a place), headers of at most `MAX_HEADER_BYTES`;
- idle keep-alive connections close after `KEEP_ALIVE_SECONDS`;
- on SIGTERM, requests still running (streams, simulations) get a part of the
  service's grace, then are cancelled, so the whole service stops within it.
"""

from __future__ import annotations

import asyncio
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 256
HEADER_TIMEOUT_SECONDS = 10.0
MAX_HEADER_BYTES = 32 * 1024
KEEP_ALIVE_SECONDS = 5


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request has not begun (its
    headers complete) within HEADER_TIMEOUT_SECONDS of connecting or of the last answer."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self.loop.call_later(HEADER_TIMEOUT_SECONDS, self._header_timeout, self.cycle)

    def _header_timeout(self, cycle_then: Any) -> None:
        """Close the connection if it is idle and no request has begun since the arming."""
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.cycle is cycle_then and not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn re-raises the signal that stopped it once it has shut down, which ends the
    process (SIGTERM) or raises KeyboardInterrupt (SIGINT) before the service stops its
    reconciler and its embedded etcd. Here `run` returns instead, and the caller cleans up."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # uvicorn's record of what to raise again


def run(app: Any, host: str, port: int, grace: float) -> None:
    """Serve `app` until SIGTERM or SIGINT; every request ends within about `grace` / 2."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        http=HeaderTimeoutProtocol,
        limit_concurrency=MAX_CONNECTIONS,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_graceful_shutdown=max(0.5, grace / 3),
    )
    _Server(config).run()
