"""Hostile values (tests/support/hostile.py) against the pure checks behind the API: the
body check names each one's field, the 422 echo can always be encoded, the job model
refuses bad text itself (a record from etcd too), and the kinds bound what a member
would choke on (the member re-checks with the same code). And token files: the one
serve makes never grants exec; one of another owner is refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from coordinator.jobs import catalog
from coordinator.jobs.command import CommandJob
from coordinator.jobs.kinds import kind_of
from coordinator.jobs.noop import check as noop_check
from coordinator.service.json_values import BadValue, check_body, encodable, text_problem
from coordinator.service.model import JobSpec
from coordinator.service.rest.auth import Role, Tokens, find_token, generated_tokens
from tests.support.hostile import PARAM_CASES, Case, job_cases


@pytest.mark.parametrize("case", job_cases(), ids=lambda case: case.body[:60])
def test_each_hostile_body_is_refused_naming_its_field(case: Case) -> None:
    with pytest.raises(BadValue) as refused:
        check_body(case.body.encode())
    assert refused.value.location == case.loc
    # The refusal itself is encodable: it never echoes the value.
    json.dumps({"loc": refused.value.location, "msg": str(refused.value)}).encode("utf-8")


@pytest.mark.parametrize(
    "body",
    [
        b'{"kind": "noop", "workers": 1, "params": {"seconds": 1e308}}',  # large, finite
        b'{"labels": {"team": "caf\\u00e9 \\ud83d\\ude00"}}',  # a surrogate pair: one emoji
        b'{"priority": 1000000000000000000000000000000}',  # an integer: any size is exact
        b"{not json",  # FastAPI names that itself
        b"[" * 100_000 + b"]" * 100_000,  # too deep to read: FastAPI refuses it
    ],
)
def test_what_json_and_utf8_can_carry_passes_the_body_check(body: bytes) -> None:
    check_body(body)


def test_a_surrogate_sent_as_raw_bytes_is_refused_too() -> None:
    # Python's JSON reader decodes bytes with `surrogatepass`: not UTF-8, yet read.
    with pytest.raises(BadValue) as refused:
        check_body(b'{"labels": {"a": "\xed\xa0\x80"}}')
    assert refused.value.location == ["labels", "a"]


def test_the_first_bad_value_in_document_order_is_named() -> None:
    body = b'{"a": [1, 2, {"b": "x\\u0000"}], "c": 1e999}'
    with pytest.raises(BadValue) as refused:
        check_body(body)
    assert refused.value.location == ["a", 2, "b"]


def test_the_echo_of_any_input_can_be_encoded() -> None:
    echo = {
        "input": ["\ud800", "a\0b", float("inf"), float("nan"), {"\udfff": -float("inf")}],
        "ctx": {"error": ValueError("x")},
        "body": b"\xed\xa0\x80 \xff",  # another content type: FastAPI echoes the bytes
        "fine": ["text", 1, 2.5, None, True],
    }
    encoded = encodable(echo)
    text = json.dumps(encoded, allow_nan=False).encode("utf-8")
    back = json.loads(text)
    assert back["input"][:4] == ["\\ud800", "a\\x00b", "inf", "nan"]
    assert back["input"][4] == {"\\udfff": "-inf"}
    assert back["fine"] == ["text", 1, 2.5, None, True]
    assert back["ctx"] == {"error": "x"}
    assert back["body"] == "\\xed\\xa0\\x80 \\xff"


@pytest.mark.parametrize(
    "spec",
    [
        {"labels": {"team": "\ud800"}},
        {"labels": {"\ud800": "a"}},
        {"params": {"seconds": "1\0"}},
        {"agent_selector": {"zone": "a\0"}},
        {"kind": "command", "command": ["/bin/echo", "a\0b"]},
        {"kind": "command", "command": ["/bin/echo"], "env": {"X": "\udfff"}},
        {"kind": "command", "command": ["/bin/echo"], "working_dir": "/tmp/\0"},
    ],
)
def test_the_job_model_refuses_nul_and_surrogates_in_every_text(spec: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate({"kind": "noop", "workers": 1, **spec})
    why = str(refused.value)
    assert "NUL" in why or "surrogate" in why or "keys are 1-63" in why, why


def test_text_problem_passes_text_and_names_what_is_wrong() -> None:
    assert text_problem("any text, ünïcödé, 😀") is None
    assert "NUL" in (text_problem("a\0") or "")
    assert "surrogate" in (text_problem("\udc80") or "")


@pytest.mark.parametrize("case", PARAM_CASES, ids=lambda case: f"{case.kind}-{case.named}")
def test_values_a_member_would_choke_on_are_refused_at_submit(case) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=case.named):
        kind_of(case.kind).check(case.params, 1)


def test_the_bounds_are_the_catalogs_and_the_member_checks_them_again() -> None:
    assert catalog.maximum(catalog.NOOP, "seconds") == 30 * 86400
    assert catalog.maximum(catalog.XGBOOST, "rounds") == 1_000_000
    assert catalog.maximum(catalog.COMMAND, "grace_seconds") == 3600
    assert noop_check({"seconds": str(30 * 86400)}) == 30 * 86400  # the bound itself is fine
    with pytest.raises(ValueError, match="seconds must be <= 2592000"):
        noop_check({"seconds": "1e308"})  # the member's own check (`noop.check` in `build`)
    with pytest.raises(ValueError, match="grace_seconds"):
        CommandJob({"grace_seconds": "inf"}, 1, ["/bin/true"])  # the member's side
    kind_of("xgboost").check({"rounds": "1000000"}, 1)


# -- token files ----------------------------------------------------------------------------


def test_the_generated_token_file_never_grants_exec(tmp_path: Path) -> None:
    made = generated_tokens(tmp_path)
    token = made.strongest()
    assert made.role(token) == Role.SUBMIT
    assert (tmp_path / "api-token").read_text().splitlines()[-1] == f"submit {token}"
    (tmp_path / "api-token").write_text(f"exec {token}\n")  # an earlier version's file
    assert generated_tokens(tmp_path).role(token) == Role.SUBMIT
    assert Tokens.load(tmp_path / "api-token").role(token) == Role.EXEC  # --token-file: exec


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file away")
def test_a_token_file_of_another_owner_is_refused_for_the_service_only(tmp_path: Path) -> None:
    path = tmp_path / "api-token"
    path.write_text("exec " + "t" * 20 + "\n")
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(ValueError, match=f"owned by uid 65534.*chown 0 {path}"):
        Tokens.load(path)
    assert find_token([tmp_path]) == "t" * 20  # the CLI reads a service's file of any owner
