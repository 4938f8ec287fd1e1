"""Mutual proof of the round's secret on a fresh connection: HMAC over both sides' nonces.

The members of one rendezvous round share a 32-byte secret from the roster (in
etcd, under the job's keys). Before a member's endpoint says or reads anything
else, both ends prove they hold it, in three fixed-size messages:

    endpoint -> caller   CHALLENGE  magic, "C", the endpoint's nonce
    caller -> endpoint   RESPONSE   magic, "R", the caller's nonce,
                                    HMAC-SHA256(secret, transcript | "caller")
    endpoint -> caller   ACCEPT     magic, "A", HMAC-SHA256(secret, transcript | "endpoint")
                         or REFUSED magic, "X", "handshake refused"

The transcript is the context (job, round and the endpoint's member id) and both
nonces, so a proof is good for one connection to one member only: it cannot be
replayed, nor reflected (each side's proof names its role). Proofs are compared
with `hmac.compare_digest`. A refusal names neither the job nor the round: a
stranger learns nothing but that it was refused.

This authenticates the peer; it does not encrypt what follows.

Pure functions first (messages, proofs, checks); the socket I/O is at the end.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

SECRET_BYTES = 32
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size
MAGIC = b"CHS1"

CHALLENGE_SIZE = len(MAGIC) + 1 + NONCE_BYTES
RESPONSE_SIZE = len(MAGIC) + 1 + NONCE_BYTES + PROOF_BYTES
ACCEPT_SIZE = len(MAGIC) + 1 + PROOF_BYTES
REFUSAL_TEXT = "handshake refused"
REFUSED = MAGIC + b"X" + REFUSAL_TEXT.encode().ljust(PROOF_BYTES)  # as long as an ACCEPT

Role = Literal["caller", "endpoint"]


class HandshakeError(ConnectionError):
    """The peer did not complete the handshake (refused it, or failed to prove the secret)."""


class HandshakeRefused(HandshakeError):
    """The endpoint refused this end's proof: the two hold different secrets."""


@dataclass(frozen=True, repr=False)
class HandshakeKey:
    """What both ends of one connection must agree on: the round's secret and the context
    (which job, round and endpoint the connection is for). Its repr hides the secret."""

    secret: bytes
    context: bytes

    def __post_init__(self) -> None:
        if len(self.secret) != SECRET_BYTES:
            raise ValueError(f"a handshake secret is {SECRET_BYTES} bytes, got {len(self.secret)}")

    def __repr__(self) -> str:
        return f"HandshakeKey(context={self.context!r})"


def new_secret() -> bytes:
    """A fresh secret for one rendezvous round."""
    return secrets.token_bytes(SECRET_BYTES)


def context(job_id: str, round_: int, member_id: str) -> bytes:
    """The context of connections to `member_id`'s endpoint in this job's round."""
    return f"coordinator-handshake-v1\n{job_id}\n{round_}\n{member_id}".encode()


def key_for(secret: bytes, job_id: str, round_: int, member_id: str) -> HandshakeKey:
    return HandshakeKey(secret, context(job_id, round_, member_id))


def proof(key: HandshakeKey, endpoint_nonce: bytes, caller_nonce: bytes, role: Role) -> bytes:
    """HMAC-SHA256 of the transcript and the prover's role, under the round's secret."""
    parts = (key.context, endpoint_nonce, caller_nonce, role.encode())
    transcript = b"".join(len(part).to_bytes(4, "big") + part for part in parts)  # unambiguous
    return hmac.new(key.secret, transcript, hashlib.sha256).digest()


def challenge(endpoint_nonce: bytes) -> bytes:
    return MAGIC + b"C" + endpoint_nonce


def response(key: HandshakeKey, endpoint_nonce: bytes, caller_nonce: bytes) -> bytes:
    return MAGIC + b"R" + caller_nonce + proof(key, endpoint_nonce, caller_nonce, "caller")


def accept(key: HandshakeKey, endpoint_nonce: bytes, caller_nonce: bytes) -> bytes:
    return MAGIC + b"A" + proof(key, endpoint_nonce, caller_nonce, "endpoint")


def read_challenge(raw: bytes) -> bytes:
    """The endpoint's nonce from its CHALLENGE; a HandshakeError for anything else."""
    if len(raw) != CHALLENGE_SIZE or raw[:5] != MAGIC + b"C":
        raise HandshakeError("the peer is not a coordinator endpoint (no handshake challenge)")
    return raw[5:]


def check_response(key: HandshakeKey, endpoint_nonce: bytes, raw: bytes) -> bytes | None:
    """The caller's nonce if its RESPONSE proves the secret, else None (never says why)."""
    if len(raw) != RESPONSE_SIZE or raw[:5] != MAGIC + b"R":
        return None
    caller_nonce, claimed = raw[5 : 5 + NONCE_BYTES], raw[5 + NONCE_BYTES :]
    expected = proof(key, endpoint_nonce, caller_nonce, "caller")
    return caller_nonce if hmac.compare_digest(claimed, expected) else None


def check_accept(key: HandshakeKey, endpoint_nonce: bytes, caller_nonce: bytes, raw: bytes) -> None:
    """Raise unless `raw` is the endpoint's ACCEPT proving the secret."""
    if raw == REFUSED:
        raise HandshakeRefused(REFUSAL_TEXT)
    if len(raw) != ACCEPT_SIZE or raw[:5] != MAGIC + b"A":
        raise HandshakeError("the peer broke off the handshake")
    expected = proof(key, endpoint_nonce, caller_nonce, "endpoint")
    if not hmac.compare_digest(raw[5:], expected):
        raise HandshakeError("the endpoint did not prove the round's secret")


# -- socket I/O ---------------------------------------------------------------


def receive_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    """`size` bytes (never more: a handshake message is small and fixed) before `deadline`;
    fewer if the peer closes or the time is up."""
    received = bytearray()
    while len(received) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(size - len(received))
        except (TimeoutError, OSError):
            break
        if not chunk:
            break
        received += chunk
    return bytes(received)


def answer(
    sock: socket.socket, key_by: Callable[[float], HandshakeKey | None], timeout: float
) -> bool:
    """The endpoint's side: True once the caller proved the secret (and got this side's
    proof); else the caller is told only "handshake refused", and False.

    `key_by(deadline)` gives the key, waiting until `deadline` if this member does not
    hold the roster yet (a prompt caller may arrive first); None if it never came.
    """
    deadline = time.monotonic() + timeout
    endpoint_nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        sock.settimeout(timeout)
        sock.sendall(challenge(endpoint_nonce))
    except OSError:
        return False
    raw = receive_exactly(sock, RESPONSE_SIZE, deadline)
    return finish(sock, key_by, endpoint_nonce, raw, deadline)


def finish(
    sock: socket.socket,
    key_by: Callable[[float], HandshakeKey | None],
    endpoint_nonce: bytes,
    raw: bytes,
    deadline: float,
) -> bool:
    """The endpoint's side once the caller's RESPONSE (`raw`) to `endpoint_nonce` is in:
    ACCEPT and True if it proves the secret, else REFUSED and False."""
    key = key_by(deadline) if len(raw) == RESPONSE_SIZE else None
    caller_nonce = check_response(key, endpoint_nonce, raw) if key is not None else None
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        if caller_nonce is None or key is None:
            sock.sendall(REFUSED)
            return False
        sock.sendall(accept(key, endpoint_nonce, caller_nonce))
    except OSError:
        return False
    return True


def offer(sock: socket.socket, key: HandshakeKey, timeout: float) -> None:
    """The caller's side: prove the secret and check the endpoint's proof, or raise
    HandshakeError (HandshakeRefused if the endpoint refused this side's proof)."""
    deadline = time.monotonic() + timeout
    endpoint_nonce = read_challenge(receive_exactly(sock, CHALLENGE_SIZE, deadline))
    caller_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(max(0.1, deadline - time.monotonic()))
    try:
        sock.sendall(response(key, endpoint_nonce, caller_nonce))
    except OSError as exc:
        raise HandshakeError(f"the handshake broke off: {exc}") from exc
    check_accept(key, endpoint_nonce, caller_nonce, receive_exactly(sock, ACCEPT_SIZE, deadline))
