"""Values read from etcd are decoded as an attacker may have written them."""

from __future__ import annotations

import pytest

from coordinator.etcd.values import json_object


@pytest.mark.parametrize(
    "value", [b"", b"not json", b"[1, 2]", b'"text"', b"17", b"null", b"\xff\xfe", b"{"]
)
def test_anything_but_a_json_object_reads_as_empty(value: bytes) -> None:
    assert json_object(value) == {}


def test_a_json_object_reads_as_itself() -> None:
    assert json_object(b'{"rank": 3, "reason": "oom"}') == {"rank": 3, "reason": "oom"}
