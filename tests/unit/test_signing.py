"""Signatures over job records and assignments (`coordinator.signing`): what verifies,
what does not, and the key files."""

from __future__ import annotations

import json
import stat
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.service.model import JobRecord, JobSpec, JobState
from coordinator.service.placement.protocol import (
    signed_assignment,
    verified_assignment,
)
from coordinator.service.store import InvalidRecord, parse_record
from coordinator.signing import (
    ASSIGNMENT,
    JOB,
    SIGNATURE,
    SignatureError,
    Signer,
    canonical,
    data_dir_key,
    load_private_key,
    load_public_key,
    loads_object,
    sign,
    verify,
)

KEY = Ed25519PrivateKey.generate()
OTHER = Ed25519PrivateKey.generate()
PAYLOAD = {"id": "j", "state": "PENDING", "spec": {"command": ["echo", "hi"], "workers": 2}}


def test_a_signature_verifies_for_its_payload_in_any_key_order() -> None:
    signature = sign(KEY, JOB, PAYLOAD)
    reordered = json.loads(json.dumps(PAYLOAD, sort_keys=True))
    verify(KEY.public_key(), JOB, reordered, signature)


@pytest.mark.parametrize(
    "changed",
    [
        {**PAYLOAD, "state": "RUNNING"},
        {**PAYLOAD, "spec": {"command": ["sh", "-c", "id"], "workers": 2}},
        {**PAYLOAD, "extra": None},
        {k: v for k, v in PAYLOAD.items() if k != "state"},
    ],
)
def test_any_change_of_the_payload_fails(changed: dict[str, Any]) -> None:
    signature = sign(KEY, JOB, PAYLOAD)
    with pytest.raises(SignatureError, match="does not verify"):
        verify(KEY.public_key(), JOB, changed, signature)


def test_a_signature_is_bound_to_its_domain_and_its_key() -> None:
    signature = sign(KEY, JOB, PAYLOAD)
    with pytest.raises(SignatureError, match="does not verify"):
        verify(KEY.public_key(), ASSIGNMENT, PAYLOAD, signature)
    with pytest.raises(SignatureError, match="does not verify"):
        verify(OTHER.public_key(), JOB, PAYLOAD, signature)


@pytest.mark.parametrize(
    ("signature", "named"),
    [(None, "missing"), (42, "malformed"), ("x" * 10, "malformed"), ("!" * 86, "malformed")],
)
def test_a_missing_or_malformed_signature_is_named(signature: object, named: str) -> None:
    with pytest.raises(SignatureError, match=named):
        verify(KEY.public_key(), JOB, PAYLOAD, signature)


def test_canonical_encoding_escapes_lone_surrogates_and_non_finite_numbers() -> None:
    assert canonical({"b": "\ud800", "a": float("inf")}) == b'{"a":Infinity,"b":"\\ud800"}'


def test_repeated_keys_are_refused() -> None:
    """A parser that kept the first of two keys would validate what was never signed."""
    with pytest.raises(SignatureError, match="'state' is repeated"):
        loads_object(b'{"state": "PENDING", "state": "RUNNING"}')
    with pytest.raises(SignatureError, match="not a JSON object"):
        loads_object(b"[1]")
    with pytest.raises(SignatureError, match="not JSON"):
        loads_object(b"\xff")


# -- job records ------------------------------------------------------------------------


def job_record() -> dict[str, Any]:
    spec = JobSpec(id="j", kind="command", workers=1, command=["echo", "hi"])
    record = JobRecord(
        id="j", uid=uuid.uuid4().hex, spec=spec, state=JobState.PENDING, conditions=[],
        submitted_at=time.time(),
    )  # fmt: skip
    return dict(json.loads(record.model_dump_json(exclude={SIGNATURE})))


def test_a_signed_record_parses_and_keeps_its_signature() -> None:
    data = job_record()
    signature = sign(KEY, JOB, data)
    parsed = parse_record("j", canonical({**data, SIGNATURE: signature}), KEY.public_key())
    assert parsed.signature == signature and parsed.spec.command == ["echo", "hi"]


@pytest.mark.parametrize(
    ("forge", "named"),
    [
        (lambda data: json.dumps(data).encode(), "signature: missing"),
        (
            lambda data: canonical({**data, SIGNATURE: sign(OTHER, JOB, data)}),
            "signature: does not verify",
        ),
        (
            lambda data: canonical(
                {
                    **data,
                    "spec": {**data["spec"], "command": ["id"]},
                    SIGNATURE: sign(KEY, JOB, data),
                }
            ),
            "signature: does not verify",
        ),
        (
            lambda data: canonical({**data, SIGNATURE: sign(KEY, ASSIGNMENT, data)}),
            "signature: does not verify",
        ),
    ],
    ids=["unsigned", "another key", "changed after signing", "an assignment's signature"],
)
def test_an_unsigned_or_forged_record_is_invalid(forge: Any, named: str) -> None:
    with pytest.raises(InvalidRecord, match=named):
        parse_record("j", forge(job_record()), KEY.public_key())


# -- assignments ------------------------------------------------------------------------


def test_an_assignment_runs_only_on_its_agent_and_registration() -> None:
    signer = Signer(KEY)
    assignment = {"registration": 7, "run_id": "j-0123abcd", "attempt": 1, "index": 0}
    raw = signed_assignment(signer, "host-a", assignment)
    verified = json.loads(verified_assignment(KEY.public_key(), "host-a", 7, raw))
    assert verified == {"run_id": "j-0123abcd", "attempt": 1, "index": 0}
    with pytest.raises(SignatureError, match="does not verify"):
        verified_assignment(KEY.public_key(), "host-b", 7, raw)  # copied to another agent
    with pytest.raises(SignatureError, match=r"registration 7 .* not this one \(9\)"):
        verified_assignment(KEY.public_key(), "host-a", 9, raw)  # an agent registered again
    forged = json.loads(raw) | {"index": 1}
    with pytest.raises(SignatureError, match="does not verify"):
        verified_assignment(KEY.public_key(), "host-a", 7, json.dumps(forged).encode())
    with pytest.raises(SignatureError, match="missing"):
        verified_assignment(KEY.public_key(), "host-a", 7, json.dumps(assignment).encode())


# -- key files --------------------------------------------------------------------------


def test_the_data_dir_key_is_made_0600_once_and_reused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = data_dir_key(data)
    private, public = data / "signing-key", data / "signing-key.pub"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    again = data_dir_key(data)
    signature = sign(again, JOB, PAYLOAD)
    verify(first.public_key(), JOB, PAYLOAD, signature)
    verify(load_public_key(public), JOB, PAYLOAD, signature)


def test_key_files_that_are_readable_by_others_or_wrong_are_refused(tmp_path: Path) -> None:
    data_dir_key(tmp_path)
    private, public = tmp_path / "signing-key", tmp_path / "signing-key.pub"
    private.chmod(0o644)
    with pytest.raises(ValueError, match="mode 0644: a signing key must be private"):
        load_private_key(private)
    public.chmod(0o600)
    with pytest.raises(ValueError, match="not a PEM Ed25519 private key"):
        load_private_key(public)  # a public key cannot sign
    with pytest.raises(ValueError, match="not a PEM Ed25519 public key"):
        load_public_key(private)
    with pytest.raises(ValueError, match="No such file"):
        load_public_key(tmp_path / "nothing")
