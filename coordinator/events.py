"""A worker's progress as JSON lines on stdout: what launchers and humans follow."""

from __future__ import annotations

import json
import time
from typing import Any


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)
