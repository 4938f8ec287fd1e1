"""An agent's output server: its members' output over HTTP
(`GET /members/<member>/output?offset=N`), so the service's logs endpoint reaches a
member on whichever host it ran.

It binds only the address it advertises, never every interface, and answers only
requests that carry the bearer token of the agent's registration (readable by the
service and the agent alone, through etcd's roles), and only about the members the
agent started. It holds at most `MAX_CONNECTIONS` connections at once (one more is
closed at once) and closes one that stays silent for `IDLE_SECONDS`: idle or slow
clients cannot keep a thread each for ever.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from coordinator.rendezvous.address import advertise_address
from coordinator.service.model import Member

ANY_ADDRESS = ("0.0.0.0", "::", "")
MAX_CONNECTIONS = 32
IDLE_SECONDS = 10.0


class CappedServer(ThreadingHTTPServer):
    """A thread per connection, at most `MAX_CONNECTIONS` of them: one beyond is closed
    unanswered (the service reads again at its next tick)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._room = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._room.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._room.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._room.release()


def output_server(
    host: str,
    port: int,
    advertise: str | None,
    etcd_endpoints: list[str],
    token: str,
    find: Callable[[str], Member | None],
    read: Callable[[Member, int], bytes],
) -> tuple[ThreadingHTTPServer, str]:
    """A server (not yet serving) on `host`:`port`, and the address it advertises:
    `advertise`, else `host`, else (`host` any address) the address that routes to etcd,
    which is then the one it binds. It answers requests bearing `token`: `find` names
    the member (None: not one of the agent's), `read` its output from a byte offset on."""
    advertised = advertise or (advertise_address(etcd_endpoints) if host in ANY_ADDRESS else host)
    bind = advertised if host in ANY_ADDRESS else host
    server = CappedServer((bind, port), _handler(token, find, read))
    port = server.server_address[1]
    address = f"[{advertised}]:{port}" if ":" in advertised else f"{advertised}:{port}"
    return server, address


def _handler(
    token: str,
    find: Callable[[str], Member | None],
    read: Callable[[Member, int], bytes],
) -> type[BaseHTTPRequestHandler]:
    class Output(BaseHTTPRequestHandler):
        timeout = IDLE_SECONDS  # each read and write of the connection, idle keep-alive too

        def do_GET(self) -> None:  # the http.server interface
            given = self.headers.get("Authorization", "")
            expected = f"Bearer {token}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                self.send_response(401)
                self.send_header("WWW-Authenticate", "Bearer")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            url = urlparse(self.path)
            parts = url.path.strip("/").split("/")
            member = (
                find(parts[1])
                if len(parts) == 3 and parts[0] == "members" and parts[2] == "output"
                else None
            )
            if member is None:
                self.send_error(404, "no such member on this agent")
                return
            try:
                offset = int(parse_qs(url.query).get("offset", ["0"])[0] or 0)
            except ValueError:
                self.send_error(400, "offset: expected a whole number of bytes")
                return
            body = read(member, max(0, offset))
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # members' output is the log that matters

    return Output
