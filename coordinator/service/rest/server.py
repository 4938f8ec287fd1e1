"""uvicorn as the service runs it: bounded, with timeouts, and quick to stop.

- at most `MAX_CONNECTIONS` connections and requests at once (beyond: 503);
- a connection must finish its request's headers within `HEADER_TIMEOUT_SECONDS`
  (slow senders do not hold a place), headers of at most `MAX_HEADER_BYTES`;
- idle keep-alive connections close after `KEEP_ALIVE_SECONDS`;
- on SIGTERM, requests still running (streams, simulations) get a part of the
  service's grace, then are cancelled, so the whole service stops within it;
- and whatever still hangs then (an etcd call wedged past its deadline, a stop that
  waits on it) is cut: the process exits `EXIT_MARGIN` seconds before the grace ends,
  so an orchestrator never has to SIGKILL it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from coordinator.exit_codes import EXIT_ERROR

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
HEADER_TIMEOUT_SECONDS = 10.0
MAX_HEADER_BYTES = 32 * 1024
KEEP_ALIVE_SECONDS = 5
#: Seconds before the end of the grace at which a shutdown still running is cut short.
EXIT_MARGIN = 0.5


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


def exit_by(seconds: float) -> threading.Thread:
    """A thread that ends the process in `seconds` unless it has ended by then: what
    holds a shutdown up (a thread in a wedged etcd call) cannot also hold the process."""

    def cut() -> None:
        time.sleep(seconds)
        log.error("shutdown still running after %.1fs: exiting now", seconds)
        os._exit(EXIT_ERROR)  # (no interpreter teardown: it would wait on the same threads)

    thread = threading.Thread(target=cut, daemon=True, name="exit-deadline")
    thread.start()
    return thread


class _Server(uvicorn.Server):
    """uvicorn re-raises the signal that stopped it once it has shut down, which ends the
    process (SIGTERM) or raises KeyboardInterrupt (SIGINT) before the service stops its
    reconciler and its embedded etcd. Here `run` returns instead, and the caller cleans up;
    the first signal also starts the clock that ends the process within the grace.
    `on_stop` is told at once (before requests still running are cancelled, which would
    answer them 500), so long requests can end with a 503 of their own."""

    on_stop: Callable[[], None] | None = None

    def __init__(self, config: uvicorn.Config, grace: float) -> None:
        super().__init__(config)
        self.grace = grace
        self._deadline: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.on_stop is not None:
            self.on_stop()
        if self._deadline is None:
            self._deadline = exit_by(max(0.1, self.grace - EXIT_MARGIN))
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # uvicorn's record of what to raise again


def run(
    app: Any, host: str, port: int, grace: float, on_stop: Callable[[], None] | None = None
) -> None:
    """Serve `app` until SIGTERM or SIGINT; every request ends within about `grace` / 2.
    `on_stop`: called (in the signal handler: it must only set a flag) when one arrives."""
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
    served = _Server(config, grace)
    served.on_stop = on_stop
    served.run()
