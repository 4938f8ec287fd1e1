"""Hostile bytes against a real parameter server behind a real member endpoint.

Every case runs against real sockets on loopback: a `ParameterServer` serving
on a `MemberEndpoint` that holds the round's secret. The checks: a caller
without the secret is told "handshake refused" and nothing else (no job, no
round, no digest, no weights); random and hostile frames from a caller with
the secret (bad magic, unknown kinds, non-int fields, huge declared lengths,
truncated headers, absurd versions) never crash a server thread, never hang
(every connection ends within the endpoint's timeouts, which are short here),
never make the server allocate beyond the declared layout, and leave the
server serving the next caller the same weights.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from coordinator.ps.optim import OptimizerSpec
from coordinator.ps.rules import UpdateRule
from coordinator.ps.server import ParameterServer
from coordinator.ps.wire import HEADER, MAGIC, Dtype, Kind, layout_digest
from coordinator.rendezvous import handshake
from coordinator.rendezvous.endpoint import MemberEndpoint
from coordinator.rendezvous.handshake import HandshakeKey, HandshakeRefused
from coordinator.rendezvous.roster import MemberAddress, Roster
from tests.support.wait import wait_until

JOB, ROUND, MEMBER = "fuzzed-job-7f3a", 4711, "server-zero"
TENSORS = [("w", torch.arange(12, dtype=torch.float32).reshape(4, 3)), ("b", torch.ones(3))]
SIZE = 15  # float32 values in the layout above
LAYOUT = layout_digest([(name, list(t.shape)) for name, t in TENSORS])
HANDSHAKE_TIMEOUT, IDLE_TIMEOUT, CAP = 1.0, 1.0, 6
REPLY_DEADLINE = 5.0  # every connection must have ended by then: the timeouts are 1 s
MAX_UPDATES = 50


@dataclass
class Served:
    server: ParameterServer
    endpoint: MemberEndpoint
    key: HandshakeKey
    thread_errors: list[BaseException]

    @property
    def port(self) -> int:
        return self.endpoint.port


@contextlib.contextmanager
def served() -> Iterator[Served]:
    """A fresh server on a fresh endpoint (trainer slots are claimed once per server); any
    exception escaping a server thread is collected, and the test fails on it."""
    errors: list[BaseException] = []
    previous = threading.excepthook

    def record(args: threading.ExceptHookArgs) -> None:
        errors.append(args.exc_value or RuntimeError(str(args.exc_type)))

    threading.excepthook = record
    secret = handshake.new_secret()
    server = ParameterServer(
        job_id=JOB,
        round_=ROUND,
        index=0,
        tensors=TENSORS,
        trainers=2,
        optimizer=OptimizerSpec("sgd", 0.1, 0.0),
        rule=UpdateRule("plain"),  # each gradient at the lr: the checks compute the steps
        max_updates=MAX_UPDATES,
    )
    endpoint = MemberEndpoint(
        JOB,
        MEMBER,
        "127.0.0.1",
        handshake_timeout=HANDSHAKE_TIMEOUT,
        idle_timeout=IDLE_TIMEOUT,
        max_connections=CAP,
    )
    endpoint.handler = server.handle
    endpoint.authorize(secret, ROUND)
    try:
        yield Served(server, endpoint, handshake.key_for(secret, JOB, ROUND, MEMBER), errors)
        # Every connection ends, and no thread died of an exception.
        wait_until(lambda: endpoint.active == 0, REPLY_DEADLINE, "every connection closed")
        assert not errors, errors
    finally:
        server.close()
        endpoint.close()
        threading.excepthook = previous


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=REPLY_DEADLINE)


def authenticated(s: Served) -> socket.socket:
    sock = connect(s.port)
    handshake.offer(sock, s.key, REPLY_DEADLINE)
    sock.settimeout(REPLY_DEADLINE)
    return sock


def frame(kind: int, a: int = 0, b: int = 0, payload: bytes = b"", **fields: int) -> bytes:
    dtype, flags = fields.get("dtype", 0), fields.get("flags", 0)
    size = fields.get("size", len(payload))
    return HEADER.pack(MAGIC, kind, dtype, flags, a, b, size) + payload


def hello(trainer: int | None, changes: dict[str, object] | None = None) -> bytes:
    body = {"job": JOB, "round": ROUND, "trainer": trainer, "layout": LAYOUT, **(changes or {})}
    return frame(Kind.HELLO, payload=json.dumps(body).encode())


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server says until it closes; fails if it has not by the deadline."""
    deadline = time.monotonic() + REPLY_DEADLINE
    received = bytearray()
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open {REPLY_DEADLINE}s") from None
        except ConnectionResetError:
            return bytes(received)
        if not chunk:
            return bytes(received)
        received += chunk


def messages(data: bytes) -> list[tuple[Kind, int, int, bytes]]:
    """The server's replies, parsed: each header well-formed, each payload complete."""
    replies = []
    while data:
        magic, kind, _, _, a, b, size = HEADER.unpack(data[: HEADER.size])
        assert magic == MAGIC
        payload = data[HEADER.size : HEADER.size + size]
        assert len(payload) == size
        replies.append((Kind(kind), a, b, payload))
        data = data[HEADER.size + size :]
    return replies


def pull_weights(s: Served) -> tuple[int, bytes]:
    """A well-behaved reader: HELLO, PULL, BYE; the version and weights it was sent."""
    with authenticated(s) as sock:
        sock.sendall(hello(None) + frame(Kind.PULL) + frame(Kind.BYE))
        sock.shutdown(socket.SHUT_WR)
        replies = messages(read_until_closed(sock))
    kinds = [r[0] for r in replies]
    assert kinds == [Kind.WELCOME, Kind.WEIGHTS, Kind.ACK], kinds
    _, version, _, weights = replies[1]
    assert len(weights) == SIZE * 4
    return version, weights


def assert_names_nothing(data: bytes) -> None:
    for secret_fact in (JOB.encode(), str(ROUND).encode(), LAYOUT.encode(), MEMBER.encode()):
        assert secret_fact not in data


# -- callers without the secret --------------------------------------------------------


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(attempt=st.binary(max_size=300))
def test_a_caller_without_the_secret_is_refused_and_told_nothing(attempt: bytes) -> None:
    """Any bytes instead of a proof: the endpoint's challenge, then "handshake refused",
    then the connection closes; the server never reads a PS frame from it."""
    with served() as s:
        before = pull_weights(s)
        with connect(s.port) as sock:
            sock.sendall(attempt)
            sock.shutdown(socket.SHUT_WR)
            data = read_until_closed(sock)
        assert data[: handshake.CHALLENGE_SIZE - handshake.NONCE_BYTES] == b"CHS1C"
        assert data[handshake.CHALLENGE_SIZE :] == handshake.REFUSED
        assert_names_nothing(data[handshake.CHALLENGE_SIZE :])
        assert pull_weights(s) == before
        assert not any(state.connected for state in s.server.trainers.values())


@pytest.mark.parametrize("what", ["hello", "pull", "poisoned push"])
def test_the_protocol_without_the_handshake_gets_no_weights_and_no_slot(what: str) -> None:
    """The old attack: talk the PS protocol at once, or after a proof with another secret."""
    request = {
        "hello": hello(0),
        "pull": hello(0) + frame(Kind.PULL),
        "poisoned push": hello(0) + frame(Kind.PUSH, 0, 1, b"\x7f" * SIZE * 4, dtype=Dtype.FLOAT32),
    }[what]
    with served() as s:
        before = pull_weights(s)
        with connect(s.port) as sock:  # no handshake at all
            sock.sendall(request)
            data = read_until_closed(sock)
        assert data[handshake.CHALLENGE_SIZE :] == handshake.REFUSED
        assert MAGIC not in data  # no WELCOME, WEIGHTS or ACK
        wrong = handshake.key_for(handshake.new_secret(), JOB, ROUND, MEMBER)
        with connect(s.port) as sock, pytest.raises(HandshakeRefused) as refused:
            handshake.offer(sock, wrong, REPLY_DEADLINE)
        assert str(refused.value) == "handshake refused"
        assert pull_weights(s) == before  # no update, and trainer 0's slot is still free
        assert not s.server.trainers[0].connected


def test_an_endpoint_without_the_secret_is_not_trusted() -> None:
    """The caller checks the endpoint's proof too: an impostor that answers the handshake
    with a made-up proof is refused by the caller."""
    with socket.create_server(("127.0.0.1", 0)) as impostor:
        port = impostor.getsockname()[1]
        key = handshake.key_for(handshake.new_secret(), JOB, ROUND, MEMBER)

        def pretend() -> None:
            conn, _ = impostor.accept()
            with conn:
                conn.sendall(handshake.challenge(secrets.token_bytes(32)))
                conn.recv(handshake.RESPONSE_SIZE)
                conn.sendall(b"CHS1A" + secrets.token_bytes(32))

        threading.Thread(target=pretend, daemon=True).start()
        with connect(port) as sock, pytest.raises(handshake.HandshakeError, match="did not prove"):
            handshake.offer(sock, key, REPLY_DEADLINE)


# -- callers with the secret, sending hostile frames -----------------------------------

u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
hostile_frames = st.builds(
    lambda magic, kind, dtype, flags, a, b, size, payload, cut: (
        HEADER.pack(magic, kind, dtype, flags, a, b, size) + payload
    )[:cut],
    magic=st.sampled_from([MAGIC, b"CPS2", b"\0\0\0\0"]) | st.binary(min_size=4, max_size=4),
    kind=st.sampled_from(list(Kind)) | st.integers(0, 255),
    dtype=st.sampled_from([0, 1]) | st.integers(0, 255),
    flags=st.just(0) | st.integers(0, 65535),
    a=st.sampled_from([0, 1, MAX_UPDATES, MAX_UPDATES + 1, 1 << 40, (1 << 64) - 1]) | u64,
    b=st.sampled_from([0, 1, 1 << 40, (1 << 41), (1 << 64) - 1]) | u64,
    size=st.sampled_from([0, SIZE * 4, SIZE * 4 - 1, 1 << 40, (1 << 64) - 1]) | u64,
    payload=st.binary(max_size=SIZE * 4 + 8),
    cut=st.integers(0, 200),
)
hostile_hellos = st.fixed_dictionaries(
    {},
    optional={
        "job": st.sampled_from([JOB, "other"]) | st.integers() | st.text(max_size=200),
        "round": st.sampled_from([ROUND, -1, 1 << 70]) | st.text(max_size=5) | st.booleans(),
        "trainer": st.sampled_from([0, 1, 2, -1, None, True, "0", 0.0, 1 << 70, [0]]),
        "layout": st.sampled_from([LAYOUT, "x" * 100]) | st.integers() | st.none(),
        "extra": st.integers(),
    },
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    opening=st.sampled_from(["nothing", "reader", "trainer"]),
    frames=st.lists(hostile_frames, min_size=1, max_size=3),
    body=hostile_hellos | st.binary(max_size=300) | st.integers(1, 4000).map(lambda n: b"[" * n),
)
def test_hostile_frames_from_a_member_never_crash_hang_or_change_the_server(
    opening: str, frames: list[bytes], body: dict[str, object] | bytes
) -> None:
    with served() as s:
        before = pull_weights(s)
        tracemalloc.start()
        try:
            with authenticated(s) as sock:
                if opening == "nothing":  # a hostile HELLO body, then the frames
                    raw = json.dumps(body).encode() if isinstance(body, dict) else body
                    sock.sendall(frame(Kind.HELLO, payload=raw))
                else:
                    sock.sendall(hello(0 if opening == "trainer" else None))
                for data in frames:
                    with contextlib.suppress(OSError):  # the server may have hung up
                        sock.sendall(data)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
                read_until_closed(sock)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # The frames' declared lengths reach 2^64 - 1; the server allocated only its own
        # small buffers (the model is 60 bytes).
        assert peak < 1 << 20, peak
        version, weights = pull_weights(s)
        # A frame may be a well-formed PUSH from the trainer: then exactly one update.
        assert version in (before[0], before[0] + 1)
        assert version > before[0] or weights == before[1]


# -- the bounds, one at a time ---------------------------------------------------------


def test_a_declared_2_to_the_40_payload_is_refused_before_a_byte_is_read() -> None:
    with served() as s:
        tracemalloc.start()
        try:
            with authenticated(s) as sock:  # a HELLO declaring 1 TiB of JSON, none sent
                sock.sendall(frame(Kind.HELLO, size=1 << 40))
                replies = messages(read_until_closed(sock))
            with authenticated(s) as sock:  # a trainer's PUSH declaring 1 TiB of float32
                sock.sendall(hello(0))
                sock.sendall(frame(Kind.PUSH, 0, 1, dtype=Dtype.FLOAT32, size=1 << 40))
                pushed = messages(read_until_closed(sock))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, peak
        assert [r[0] for r in replies] == [Kind.ERROR]
        assert b"expected a small JSON body" in replies[0][3]
        assert [r[0] for r in pushed] == [Kind.WELCOME]  # then closed, the trainer gone
        assert "expected 60 bytes" in s.server.trainers[0].gone


def test_push_pull_answers_the_weights_with_the_gradient_applied_and_is_checked() -> None:
    with served() as s:
        start, weights = pull_weights(s)
        grad = torch.ones(SIZE).numpy().tobytes()
        with authenticated(s) as sock:  # a trainer: gradient in, weights out, one request
            sock.sendall(hello(0) + frame(Kind.PUSH_PULL, start, 1, grad, dtype=Dtype.FLOAT32))
            sock.sendall(frame(Kind.BYE))
            sock.shutdown(socket.SHUT_WR)
            replies = messages(read_until_closed(sock))
        assert [r[0] for r in replies] == [Kind.WELCOME, Kind.WEIGHTS, Kind.ACK]
        _, version, staleness, fresh = replies[1]
        assert (version, staleness) == (start + 1, 0)
        expected = torch.frombuffer(bytearray(weights), dtype=torch.float32) - 0.1
        assert torch.equal(torch.frombuffer(bytearray(fresh), dtype=torch.float32), expected)
        assert pull_weights(s) == (version, fresh)
        with authenticated(s) as sock:  # a reader may not push
            sock.sendall(hello(None) + frame(Kind.PUSH_PULL, version, 1, grad, dtype=Dtype.FLOAT32))
            sock.shutdown(socket.SHUT_WR)
            refused = messages(read_until_closed(sock))
        assert [r[0] for r in refused] == [Kind.WELCOME, Kind.ERROR]
        assert b"a reader cannot push" in refused[1][3]
        with authenticated(s) as sock:  # not the layout's size: refused before reading it
            sock.sendall(
                hello(1) + frame(Kind.PUSH_PULL, version, 1, grad[:8], dtype=Dtype.FLOAT32)
            )
            sock.shutdown(socket.SHUT_WR)
            assert [r[0] for r in messages(read_until_closed(sock))] == [Kind.WELCOME]
        assert pull_weights(s) == (version, fresh)
        assert s.server.optimizer.steps == 1
        assert "expected 60 bytes" in s.server.trainers[1].gone


def test_an_absurd_pull_is_an_error_not_a_wait() -> None:
    with served() as s:
        with authenticated(s) as sock:
            began = time.monotonic()
            sock.sendall(hello(None) + frame(Kind.PULL, a=1 << 62))
            replies = messages(read_until_closed(sock))
        assert [r[0] for r in replies] == [Kind.WELCOME, Kind.ERROR]
        assert b"beyond the last this run can reach" in replies[1][3]
        assert time.monotonic() - began < IDLE_TIMEOUT  # refused at once
        with authenticated(s) as sock:  # a version that may come, but does not: bounded
            began = time.monotonic()
            sock.sendall(hello(None) + frame(Kind.PULL, a=MAX_UPDATES))
            replies = messages(read_until_closed(sock))
        assert [r[0] for r in replies] == [Kind.WELCOME, Kind.ERROR]
        assert b"in vain" in replies[1][3]
        assert IDLE_TIMEOUT <= time.monotonic() - began < REPLY_DEADLINE


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"trainer": "0"}, "trainer"),
        ({"trainer": True}, "trainer"),
        ({"trainer": 1.5}, "trainer"),
        ({"trainer": 7}, "not one of the 2 trainers"),
        ({"round": "4711"}, "round"),
        ({"colour": "red"}, "colour"),
        ({"trainer": [[[[0]]]]}, "trainer"),
    ],
)
def test_a_mistyped_hello_is_refused_naming_the_field(
    changes: dict[str, object], field: str
) -> None:
    with served() as s:
        with authenticated(s) as sock:
            sock.sendall(hello(0, changes))
            replies = messages(read_until_closed(sock))
        assert [r[0] for r in replies] == [Kind.ERROR]
        message = json.loads(replies[0][3])["message"]
        assert field in message, message
        assert not any(state.connected for state in s.server.trainers.values())


@pytest.mark.parametrize(
    "body", [b"[" * 4000, b"\xff\xfe", b"[1, 2]", b"null", b'{"job": "' + b"\\" * 2000]
)
def test_a_hello_that_is_no_json_object_is_refused(body: bytes) -> None:
    """Nested too deep for the parser, not UTF-8, not an object, unterminated."""
    with served() as s:
        with authenticated(s) as sock:
            sock.sendall(frame(Kind.HELLO, payload=body))
            replies = messages(read_until_closed(sock))
        assert [r[0] for r in replies] == [Kind.ERROR]
        assert b"HELLO: body is not" in replies[0][3]


def test_a_trainer_slot_is_claimed_once() -> None:
    with served() as s, authenticated(s) as first:
        first.sendall(hello(1))
        header = HEADER.unpack(first.recv(HEADER.size))
        assert header[1] == Kind.WELCOME
        with authenticated(s) as second:
            second.sendall(hello(1))
            replies = messages(read_until_closed(second))
        assert json.loads(replies[0][3])["message"] == "trainer 1 is already connected"


def test_silent_callers_are_dropped_after_the_timeouts() -> None:
    with served() as s:
        began = time.monotonic()
        with connect(s.port) as sock:  # says nothing in the handshake
            data = read_until_closed(sock)
        assert data[handshake.CHALLENGE_SIZE :] == handshake.REFUSED
        assert HANDSHAKE_TIMEOUT <= time.monotonic() - began < REPLY_DEADLINE
        began = time.monotonic()
        with authenticated(s) as sock:  # proves the secret, then half a header, then nothing
            sock.sendall(frame(Kind.HELLO)[:10])
            assert read_until_closed(sock) == b""
        assert IDLE_TIMEOUT <= time.monotonic() - began < REPLY_DEADLINE


def test_idle_connections_never_shut_out_a_real_caller_and_channels_are_capped() -> None:
    """Pending handshakes are counted apart from channels (issue 28): idle connections
    from one source hold at most half the pending room, the oldest silent ones make room
    for newcomers, and a real caller still gets in; proven callers past `CAP` channels
    are closed unanswered."""
    with served() as s:
        per_source = max(128, 2 * CAP) // 2
        idle = [connect(s.port) for _ in range(per_source + 20)]
        try:
            for sock in idle:  # each got its challenge
                assert len(sock.recv(handshake.CHALLENGE_SIZE)) > 0
            wait_until(lambda: s.endpoint.pending == per_source, 5, "one source's half held")
            for sock in idle[:20]:  # the oldest made room: closed, nothing more said
                with contextlib.suppress(ConnectionResetError):
                    assert read_until_closed(sock) == b""
            assert pull_weights(s)[0] == 0  # a real caller gets in all the same
        finally:
            for sock in idle:
                sock.close()
        channels = [authenticated(s) for _ in range(CAP)]
        try:
            began = time.monotonic()
            with connect(s.port) as extra, pytest.raises(handshake.HandshakeError, match="broke"):
                handshake.offer(extra, s.key, REPLY_DEADLINE)
            assert time.monotonic() - began < IDLE_TIMEOUT
        finally:
            for sock in channels:
                sock.close()
        wait_until(lambda: s.endpoint.active == 0, REPLY_DEADLINE, "every connection closed")
        assert pull_weights(s)[0] == 0  # admitted again


def test_the_roster_shows_its_secret_only_to_etcd() -> None:
    """The worker's `done` event prints `model_dump()`; only `to_etcd` carries the secret."""
    secret = handshake.new_secret()
    member = MemberAddress(rank=0, member_id=MEMBER, host="127.0.0.1", port=1)
    roster = Roster(job_id=JOB, round=ROUND, world_size=1, members=[member], secret=secret.hex())
    shown = [json.dumps(roster.model_dump()), roster.model_dump_json(), repr(roster), str(roster)]
    shown.append(repr(roster.key_for(member)))
    for text in shown:
        assert secret.hex() not in text and "secret" not in text, text
    again = Roster.from_etcd(roster.to_etcd().encode())
    assert again.secret_bytes == secret and again == roster
    with pytest.raises(ValidationError, match="secret"):
        Roster.from_etcd(roster.model_dump_json().encode())  # no secret: not a roster
