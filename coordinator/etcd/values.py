"""Values read from etcd, decoded as untrusted: anyone with write access to a key may have
put anything there, so a reader gets a usable value or an empty one, never an exception."""

from __future__ import annotations

import json
from typing import Any


def json_object(value: bytes) -> dict[str, Any]:
    """`value` as a JSON object; empty when it is not one (or not JSON at all)."""
    try:
        decoded = json.loads(value)
    except ValueError:
        return {}
    return decoded if isinstance(decoded, dict) else {}
