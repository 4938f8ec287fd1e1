"""What a JSON body may hold: finite numbers, and text that is text.

Python's JSON reader takes `NaN`, `Infinity` and `1e999` (as infinity), a lone
surrogate (`"\\ud800"`) and a NUL (`"\\u0000"`). None of them can be stored,
encoded back or handed to a program: infinity has no JSON, a lone surrogate no
UTF-8, a NUL no place in a C string (argv, env, paths). The API refuses each at
the boundary with a 422 naming the field (`check_body`); the job model refuses
the same text again (`text_problem`), so a record from etcd cannot carry one.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


class BadValue(ValueError):
    """A value no answer could carry; `location` is its path in the document."""

    def __init__(self, location: list[str | int], message: str) -> None:
        super().__init__(message)
        self.location = location


def text_problem(text: str) -> str | None:
    """Why `text` cannot be taken (a lone surrogate, a NUL), or None."""
    if "\0" in text:
        return "a NUL character is not allowed in text"
    if _SURROGATE.search(text):
        return "a lone surrogate (\\ud800-\\udfff) is not text: send UTF-8"
    return None


class _NonFinite:
    """What the reader returns in place of a number no float holds."""

    def __init__(self, text: str) -> None:
        self.text = text


def _number(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def check_body(body: bytes) -> None:
    """Raise BadValue naming the first non-finite number or bad text (in a value or a key)
    of a JSON body; say nothing of a body that is not JSON (FastAPI names that itself)."""
    try:
        document = json.loads(body, parse_constant=_NonFinite, parse_float=_number)
    except (ValueError, RecursionError):
        return
    pending: list[tuple[list[str | int], Any]] = [([], document)]
    while pending:  # iterative, in document order: deep nesting must not exhaust the stack
        location, value = pending.pop()
        if isinstance(value, _NonFinite):
            raise BadValue(location, f"{_shown(value.text)} is not a number JSON can carry back")
        if isinstance(value, str):
            problem = text_problem(value)
            if problem:
                raise BadValue(location, problem)
        elif isinstance(value, dict):
            for key in value:
                problem = text_problem(key)
                if problem:
                    raise BadValue(location, f"a key: {problem}")
            pending += reversed([([*location, key], item) for key, item in value.items()])
        elif isinstance(value, list):
            pending += reversed([([*location, index], item) for index, item in enumerate(value)])


def _shown(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def encodable(value: Any) -> Any:
    """`value` (an error's echo: lists, dicts, text, bytes, numbers, exceptions) with what
    JSON cannot carry made printable: text and bytes escaped where they hold a surrogate,
    a NUL or what is not UTF-8, a non-finite number as its text, anything else as its
    text. So a 422 can always be sent."""
    if isinstance(value, bytes):  # a body FastAPI did not read as JSON (another type)
        value = value.decode("utf-8", "backslashreplace")
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8").replace("\0", "\\x00")
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {encodable(str(key)): encodable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [encodable(item) for item in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    return encodable(str(value))
