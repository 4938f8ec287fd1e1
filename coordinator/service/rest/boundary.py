"""The API's front door: who asks, and how much they send, decided before the body is read.

A pure ASGI middleware, in front of everything FastAPI does: for every route that
needs a role it checks the bearer token from the headers alone, so an unauthenticated
request of any size or content gets a 401 without a byte of its body being received.
Bodies are capped (by Content-Length, and by counting what streams in: 413). A JSON
body is decoded here once, within the cap, to refuse non-finite numbers (NaN,
Infinity, 1e999), lone surrogates and NULs (422 naming the field: Python's JSON
reads them, but no answer, store or program could carry them on; `json_values`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from coordinator.service.json_values import BadValue, check_body
from coordinator.service.rest.auth import Role, Tokens

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ROLE_KEY = "coordinator.role"  # the scope's entry where the granted role is left for routes
#: The scope's entry holding an asyncio.Event set once the client of a request with a body
#: has gone (a long handler stops its work then; Starlette's `is_disconnected` does not see
#: it through a BaseHTTPMiddleware).
GONE_KEY = "coordinator.client_gone"
MAX_BODY_BYTES = 1024 * 1024  # a job spec or a simulation request is a few hundred bytes
DECODE_INLINE_BYTES = 64 * 1024  # larger bodies are decoded in a thread, off the event loop

#: Routes anyone may call: the page and its files, health, and the API's own description.
OPEN_PATHS = frozenset(
    {"/", "/healthz", "/readyz", "/v1/whoami", "/openapi.json", "/docs", "/redoc",
     "/docs/oauth2-redirect"}
)  # fmt: skip
OPEN_PREFIXES = ("/ui/",)
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def required_role(method: str, path: str) -> Role | None:
    """The role a request needs: none for the open routes, `read` to look, `submit` for
    anything that changes something. Everything not listed open needs a token (deny by
    default: a route added later is protected until someone opens it on purpose)."""
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
        return None
    return Role.READ if method.upper() in READ_METHODS else Role.SUBMIT


def bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if there is one."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def granted_role(tokens: Tokens | None, headers: list[tuple[bytes, bytes]]) -> Role | None:
    """The role the request's token carries (`exec` for all where there are no tokens)."""
    if tokens is None:
        return Role.EXEC
    token = bearer(headers)
    return tokens.role(token) if token else None


def refusal(needed: Role, granted: Role | None) -> tuple[int, str] | None:
    """(status, message) when `granted` does not cover `needed`, else None."""
    if granted is None:
        return 401, "a valid bearer token is required"
    if not granted.covers(needed):
        return 403, f"this token's role is {granted}; this needs {needed}"
    return None


class Boundary:
    """The middleware (see the module docstring)."""

    def __init__(self, app: AsgiApp, tokens: Tokens | None, max_body: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.tokens = tokens
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        needed = required_role(scope["method"], scope["path"])
        granted = granted_role(self.tokens, scope["headers"])
        scope[ROLE_KEY] = granted
        if needed is not None:
            refused = refusal(needed, granted)
            if refused is not None:
                extra = [(b"www-authenticate", b"Bearer")] if refused[0] == 401 else []
                close = _has_body(scope["headers"])
                await _answer(send, refused[0], {"detail": refused[1]}, extra, close=close)
                return
        length = _content_length(scope["headers"])
        if length is not None and length > self.max_body:
            await _answer(send, 413, {"detail": _too_large(self.max_body)}, close=True)
            return
        if not _has_body(scope["headers"]):
            await self.app(scope, receive, send)  # no body: streams pass straight through
            return
        body, rest = await self._body(receive)
        if body is None:
            await _answer(send, 413, {"detail": _too_large(self.max_body)}, close=True)
            return
        if body and _is_json(scope["headers"]):
            try:
                if len(body) > DECODE_INLINE_BYTES:
                    await asyncio.to_thread(check_body, body)
                else:
                    check_body(body)
            except BadValue as exc:
                detail = [{"loc": ["body", *exc.location], "msg": str(exc), "type": "value_error"}]
                await _answer(send, 422, {"detail": detail})
                return
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch(receive, rest, gone))
        scope[GONE_KEY] = gone
        try:
            await self.app(scope, _replay(body, gone), send)
        finally:
            watcher.cancel()

    async def _body(self, receive: Receive) -> tuple[bytes | None, list[Message]]:
        """The whole body (None once it passes the cap), and any message after it."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return b"".join(chunks), [message]
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None, []
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), []


def document_refusals(app: Any) -> None:
    """Add this middleware's answers (401, 403, 413) to the app's OpenAPI description, on
    the operations whose route needs a role, so clients and fuzzers know them."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                needed = required_role(method, path)
                if needed is None or not isinstance(operation, dict):
                    continue
                responses = operation.setdefault("responses", {})
                responses.setdefault("401", {"description": "no valid bearer token"})
                if needed == Role.SUBMIT:
                    responses.setdefault("403", {"description": "the token may only read"})
                    responses.setdefault("413", {"description": "the body is over the cap"})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _replay(body: bytes, gone: asyncio.Event) -> Receive:
    """A `receive` that gives the buffered body once, then waits for the client to go."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


async def _watch(receive: Receive, rest: list[Message], gone: asyncio.Event) -> None:
    """After the body, the server's next message can only be the client's going: the one
    reader of it, so a handler and the framework both learn of it through `gone`."""
    for message in rest:
        if message["type"] == "http.disconnect":
            gone.set()
            return
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request announces a body (which an early answer leaves unread)."""
    for name, value in headers:
        if name.lower() == b"transfer-encoding":
            return True
        if name.lower() == b"content-length" and value.strip() not in (b"", b"0"):
            return True
    return False


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name.lower() == b"content-type":
            return b"json" in value.lower()
    return True  # FastAPI reads a body without a content type as JSON too


def _too_large(limit: int) -> str:
    return f"the body is larger than {limit:,} bytes"


async def _answer(
    send: Send,
    status: int,
    body: dict[str, Any],
    headers: list[tuple[bytes, bytes]] | None = None,
    close: bool = False,
) -> None:
    """A small JSON answer; `close` ends the connection (a body left unread cannot be
    skipped to reach the next request)."""
    payload = json.dumps(body).encode()
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        *(headers or []),
    ]
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": payload})
