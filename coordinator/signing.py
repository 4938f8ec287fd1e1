"""Ed25519 signatures over what the service writes for others to act on.

Anyone who reaches etcd (a tenant's credentials, the raft peer port) could write a
job record or an agent's assignment. The leader and the agents act only on what
the service signed: a job record (`JOB`) and an assignment (`ASSIGNMENT`) carry a
signature, over a canonical JSON encoding of everything else, prefixed with its
domain so that a signature made for one kind of value never verifies as another.
The private key stays with the service (its data dir, or a secret); agents hold
the public key, which can verify but never sign.

Pure functions on the values, and key files loaded with a clear error.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from coordinator.files import check_secret_mode

JOB = b"coordinator job v1"
ASSIGNMENT = b"coordinator assignment v1"
SIGNATURE = "signature"  # the field of the signed value that holds its signature
PRIVATE_NAME = "signing-key"  # in the service's data dir, when no --signing-key is given
PUBLIC_NAME = "signing-key.pub"


class SignatureError(ValueError):
    """A value's signature is missing, malformed, or not the service's."""


def canonical(payload: Any) -> bytes:
    """One encoding per value: sorted keys, no spaces, ASCII only (lone surrogates are
    escaped, never an encoding error)."""
    return json.dumps(
        payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True
    ).encode()


def _message(domain: bytes, payload: Any) -> bytes:
    return domain + b"\n" + canonical(payload)


def sign(key: Ed25519PrivateKey, domain: bytes, payload: Any) -> str:
    """The signature of `payload` in `domain`, as URL-safe base64 (86 characters)."""
    return base64.urlsafe_b64encode(key.sign(_message(domain, payload))).decode().rstrip("=")


def verify(key: Ed25519PublicKey, domain: bytes, payload: Any, signature: object) -> None:
    """Raise `SignatureError` unless `signature` is the service's over `payload` in
    `domain`."""
    if signature is None:
        raise SignatureError("missing: the service signs everything it writes")
    if not isinstance(signature, str) or len(signature) != 86:
        raise SignatureError("malformed: not 86 characters of base64")
    try:
        raw = base64.b64decode(signature + "==", altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError("malformed: not base64") from None
    if len(raw) != 64:
        raise SignatureError("malformed: not 64 bytes")
    try:
        key.verify(raw, _message(domain, payload))
    except InvalidSignature:
        raise SignatureError("does not verify with the service's key") from None


def split(document: object) -> tuple[dict[str, Any], object]:
    """A signed JSON object as (its payload: every field but the signature, the
    signature); `SignatureError` when it is no object."""
    if not isinstance(document, dict):
        raise SignatureError("the value is not a JSON object")
    payload = {k: v for k, v in document.items() if k != SIGNATURE}
    return payload, document.get(SIGNATURE)


def loads_object(raw: bytes | str) -> dict[str, Any]:
    """A JSON object, refusing repeated keys: what is verified is what is validated."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for key, value in pairs:
            if key in found:
                raise SignatureError(f"the key {key!r} is repeated")
            found[key] = value
        return found

    try:
        document = json.loads(raw, object_pairs_hook=unique)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, SignatureError):
            raise
        raise SignatureError(f"not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise SignatureError("the value is not a JSON object")
    return document


# -- key files --------------------------------------------------------------------------


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """The service's key (PEM, PKCS#8), from a private file (`check_secret_mode`)."""
    try:
        info = path.stat()
        pem = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    check_secret_mode(path, info, "a signing key")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: not a PEM Ed25519 private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path}: not an Ed25519 private key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    """The service's public key (PEM), which agents verify with."""
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    except (TypeError, ValueError):
        raise ValueError(f"{path}: not a PEM Ed25519 public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path}: not an Ed25519 public key")
    return key


def public_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def write_key_pair(private: Path, public: Path) -> Ed25519PrivateKey:
    """A new key in `private` (0600, created only if absent) and its public half."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(pem)
    public.write_bytes(public_pem(key))
    return key


def data_dir_key(data_dir: Path) -> Ed25519PrivateKey:
    """`DATA_DIR/signing-key`, made (with `signing-key.pub`) on the first start."""
    private, public = data_dir / PRIVATE_NAME, data_dir / PUBLIC_NAME
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        key = write_key_pair(private, public)
    except FileExistsError:
        key = load_private_key(private)
        if not public.exists() or public.read_bytes() != public_pem(key):
            public.write_bytes(public_pem(key))
    return key


class Signer:
    """The service's key: signs what it writes, and verifies what it reads back."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self.key = key
        self.public = key.public_key()

    def sign(self, domain: bytes, payload: Any) -> str:
        return sign(self.key, domain, payload)

    def verify(self, domain: bytes, payload: Any, signature: object) -> None:
        verify(self.public, domain, payload, signature)
