"""Hostile values for the API's inputs (issue 28, item 6): each one answered 500 once.

Bodies are raw JSON text (the escapes `\\ud800` and `\\u0000` are what a client sends;
Python's `json` turns them into a lone surrogate and a NUL), each with the location the
422 must name. The unit tests feed them to the body check, the system tests to a real
`coordinator serve`, and the schemathesis run sends them as explicit cases.
"""

from __future__ import annotations

from typing import NamedTuple

#: Numbers JSON writes but no float holds: Python reads them as infinity.
HUGE_NUMBERS = ("1e999", "1e400", "-1e999", "1E+400")
#: Text that is not text: lone surrogates (no UTF-8 for them), and NUL (no C string).
BAD_TEXT = ("\\ud800", "\\udfff", "a\\ud83db", "\\u0000", "nul\\u0000inside")


class Case(NamedTuple):
    path: str  # the endpoint posted to
    body: str  # raw JSON text
    loc: list[str | int]  # where the 422 must point (after "body")


NOOP = '{"kind": "noop", "workers": 1, %s}'
COMMAND = '{"kind": "command", "workers": 1, "command": ["true"], %s}'


def job_cases() -> list[Case]:
    """A hostile value in each kind of field of a job spec."""
    cases = []
    for number in HUGE_NUMBERS:
        cases += [
            Case("/v1/jobs", NOOP % f'"deadline_seconds": {number}', ["deadline_seconds"]),
            Case("/v1/jobs", NOOP % f'"priority": {number}', ["priority"]),
            Case("/v1/jobs", NOOP % f'"params": {{"seconds": {number}}}', ["params", "seconds"]),
            Case("/v1/jobs", f'{{"kind": "noop", "workers": {number}}}', ["workers"]),
        ]
    for text in BAD_TEXT:
        cases += [
            Case("/v1/jobs", NOOP % f'"labels": {{"team": "{text}"}}', ["labels", "team"]),
            Case("/v1/jobs", NOOP % f'"labels": {{"{text}": "a"}}', ["labels"]),
            Case("/v1/jobs", NOOP % f'"params": {{"seconds": "{text}"}}', ["params", "seconds"]),
            Case("/v1/jobs", NOOP % f'"id": "{text}"', ["id"]),
            Case("/v1/jobs", f'{{"kind": "{text}", "workers": 1}}', ["kind"]),
            Case(
                "/v1/jobs",
                NOOP % f'"agent_selector": {{"gpu": "{text}"}}',
                ["agent_selector", "gpu"],
            ),
            Case(
                "/v1/jobs",
                f'{{"kind": "command", "workers": 1, "command": ["/bin/echo", "{text}"]}}',
                ["command", 1],
            ),
            Case(
                "/v1/jobs",
                COMMAND % f'"env": {{"X": "{text}"}}',
                ["env", "X"],
            ),
            Case("/v1/simulate", f'{{"delay": "{text}"}}', ["delay"]),
        ]
    cases += [Case("/v1/simulate", f'{{"seconds": {n}}}', ["seconds"]) for n in HUGE_NUMBERS]
    return cases


class ParamCase(NamedTuple):
    kind: str
    params: dict[str, str]
    named: str  # the parameter the refusal must name


#: Parameters the member would choke on (or run for ever with), refused at submit.
PARAM_CASES = [
    ParamCase("noop", {"seconds": "1e308"}, "seconds"),
    ParamCase("noop", {"seconds": "inf"}, "seconds"),
    ParamCase("noop", {"seconds": "nan"}, "seconds"),
    ParamCase("noop", {"seconds": "2592001"}, "seconds"),  # 30 days and a second
    ParamCase("xgboost", {"rounds": "1000001"}, "rounds"),
    ParamCase("xgboost", {"rounds": "9" * 400}, "rounds"),
    ParamCase("command", {"grace_seconds": "3601"}, "grace_seconds"),
    ParamCase("command", {"grace_seconds": "Infinity"}, "grace_seconds"),
]


#: Bodies under other content types (FastAPI then echoes the raw bytes in its 422) and
#: bytes that are not UTF-8: each a 500 once, through the 422's echo.
OTHER_TYPES = (
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data",
    "application/json; charset=latin-1",
)
RAW_BODIES = (
    b"\xed\xa0\x80",
    b"\xff\xfe",
    b'{"kind": "noop", "workers": 1, "labels": {"a": "\xed\xa0\x80"}}',
    b'{"kind": "noop", "workers": "x\\ud800"}',
    b'{"kind": "noop", "workers": 1e999}',
)
