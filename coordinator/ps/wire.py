"""The parameter-server wire format: a fixed typed header, then raw bytes.

A connection carries it only after the member endpoint's handshake
(`coordinator.rendezvous.handshake`): the peer has proved the round's secret.

Every message is a 32-byte header, `!4sBBHQQQ`: magic `CPS1`, kind, dtype,
flags (0), two 64-bit fields whose meaning depends on the kind, and the
length of the payload that follows. Payloads are either UTF-8 JSON (HELLO,
WELCOME, errors; at most `MAX_JSON` bytes) or raw little-endian float32 tensors
laid out as the two ends agreed in HELLO (`layout_digest`). A declared length
is checked before a byte of the payload is read. Nothing is unpickled.

Tensors are sent from and received into their own memory (`sendmsg` with a
list of buffers, `recv_into` a view of the destination), so a pull or a push
costs no copy on either side beyond the kernel's.
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAGIC = b"CPS1"
HEADER = struct.Struct("!4sBBHQQQ")
MAX_JSON = 4096  # HELLO, WELCOME and errors are small; anything bigger is refused unread


class Kind(IntEnum):
    HELLO = 1  # trainer -> server: JSON {job, round, rank, role, layout}
    WELCOME = 2  # server -> trainer: a = version, b = the trainer's clock; JSON {server}
    PULL = 3  # trainer -> server: a = the least version wanted
    WEIGHTS = 4  # server -> trainer: a = version, b = 0 (after PUSH_PULL: staleness); float32
    PUSH = 5  # trainer -> server: a = version computed from, b = trainer clock; float32
    ACK = 6  # server -> trainer: a = version after applying, b = staleness
    BYE = 7  # trainer -> server: done
    ERROR = 8  # either way: JSON {message}
    PUSH_PULL = 9  # trainer -> server: as PUSH; answered by WEIGHTS with b = staleness


class Dtype(IntEnum):
    NONE = 0
    FLOAT32 = 1


class ProtocolError(ConnectionError):
    """The peer sent something this end cannot accept, or closed the connection."""


class PeerClosed(ProtocolError):
    """The connection ended (the peer died, or closed it): noticed at once by the reader."""


@dataclass(frozen=True)
class Header:
    kind: Kind
    dtype: Dtype
    a: int
    b: int
    size: int


def tune(sock: socket.socket) -> None:
    """No Nagle delay (a push is answered at once), and a dead peer noticed within seconds
    even when no packet arrives from it (keepalive probes every second, 3 tries)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def send(
    sock: socket.socket,
    kind: Kind,
    a: int = 0,
    b: int = 0,
    payload: Sequence[memoryview | bytes] = (),
    dtype: Dtype = Dtype.NONE,
) -> None:
    """One message: the header and the payload buffers, gathered by the kernel."""
    views = [memoryview(part).cast("B") for part in payload]
    size = sum(view.nbytes for view in views)
    buffers = [memoryview(HEADER.pack(MAGIC, kind, dtype, 0, a, b, size)), *views]
    try:
        while buffers:
            sent = sock.sendmsg(buffers)
            while buffers and sent >= buffers[0].nbytes:
                sent -= buffers[0].nbytes
                buffers.pop(0)
            if buffers and sent:
                buffers[0] = buffers[0][sent:]
    except OSError as exc:
        raise PeerClosed(f"sending {kind.name} failed: {exc}") from exc


def send_json(
    sock: socket.socket, kind: Kind, body: dict[str, Any], a: int = 0, b: int = 0
) -> None:
    send(sock, kind, a, b, [json.dumps(body).encode()])


def receive_header(sock: socket.socket) -> Header:
    raw = bytearray(HEADER.size)
    receive_into(sock, memoryview(raw))
    magic, kind, dtype, flags, a, b, size = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"not a parameter-server message (magic {bytes(magic)!r})")
    if flags:
        raise ProtocolError(f"header flags must be 0, got {flags}")
    try:
        return Header(Kind(kind), Dtype(dtype), a, b, size)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind} or dtype {dtype}") from None


def expect_no_payload(header: Header) -> None:
    """PULL and BYE carry nothing: a payload would be read as the next header."""
    if header.size or header.dtype != Dtype.NONE:
        raise ProtocolError(f"{header.kind.name} carries no payload, got {header.size} B")


def receive_into(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` exactly from the socket (no intermediate buffer)."""
    view = view.cast("B")
    got = 0
    while got < view.nbytes:
        try:
            n = sock.recv_into(view[got:])
        except OSError as exc:
            raise PeerClosed(f"connection broken: {exc}") from exc
        if n == 0:
            raise PeerClosed("the peer closed the connection")
        got += n


def receive_json(sock: socket.socket, header: Header) -> dict[str, Any]:
    if header.dtype != Dtype.NONE or header.size > MAX_JSON:
        raise ProtocolError(f"{header.kind.name}: expected a small JSON body, got {header.size} B")
    raw = bytearray(header.size)
    receive_into(sock, memoryview(raw))
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested too deep
        raise ProtocolError(f"{header.kind.name}: body is not JSON") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{header.kind.name}: body is not a JSON object")
    return body


def receive_tensor(sock: socket.socket, header: Header, into: memoryview) -> None:
    """A float32 payload of exactly `into`'s size, received straight into it."""
    if header.dtype != Dtype.FLOAT32 or header.size != into.nbytes:
        raise ProtocolError(
            f"{header.kind.name}: expected {into.nbytes} bytes of float32, got {header.size} "
            f"bytes of {header.dtype.name}"
        )
    receive_into(sock, into)


def expect(sock: socket.socket, *kinds: Kind) -> Header:
    """The next header, which must be one of `kinds`; an ERROR from the peer is raised."""
    header = receive_header(sock)
    if header.kind == Kind.ERROR:
        raise ProtocolError(f"the peer refused: {receive_json(sock, header).get('message')}")
    if header.kind not in kinds:
        raise ProtocolError(
            f"expected {' or '.join(k.name for k in kinds)}, got {header.kind.name}"
        )
    return header


class Hello(BaseModel):
    """HELLO's body, typed strictly: `trainer` is a trainer index (an int, not a bool
    or a string) or null for a reader; no other fields."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    job: str = Field(max_length=128)
    round: int = Field(ge=0, lt=1 << 63)
    trainer: int | None = Field(ge=0, lt=1 << 31)
    layout: str = Field(max_length=64)


def read_hello(body: dict[str, Any]) -> Hello:
    """HELLO's body checked; a ProtocolError names the bad fields (never their values)."""
    try:
        return Hello.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False)
        )
        raise ProtocolError(f"HELLO: {problems}") from None


def layout_digest(layout: Sequence[tuple[str, Sequence[int]]]) -> str:
    """Names and shapes of the float32 tensors a connection carries, in order: both ends
    compare it in the handshake, so a mismatched model is refused, not misread."""
    text = json.dumps([[name, list(shape)] for name, shape in layout])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
