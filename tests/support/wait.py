"""Polling for a condition: what tests and bench scripts wait on when there is no event."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class WaitTimeout(AssertionError):
    """A condition that did not hold in time: a test failure, which bench scripts that
    carry on past it catch by this name (not every AssertionError)."""


def wait_until(condition: Callable[[], Any], timeout: float, what: str, every: float = 0.02) -> Any:
    """Poll `condition` every `every` seconds until it is truthy and return its value;
    raise WaitTimeout naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)
