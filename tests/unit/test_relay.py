"""The relay decides on the parsed object and leaves no line end but `\\n` (issue 28,
item 5): whatever a `command` program prints, every reader (however it splits the
member's output) finds plain lines, `output` events, and reports under the member's
rank, never an event of the member's own (pure)."""

from __future__ import annotations

import json
import re

from hypothesis import example, given, settings
from hypothesis import strategies as st

from coordinator.events import (
    SEPARATORS,
    Done,
    Failed,
    Output,
    Phase,
    Report,
    RosterView,
    claims_event,
    neutralise,
    parse_event,
    split_lines,
)
from coordinator.jobs.relay import relayed
from coordinator.rendezvous.roster import MemberAddress

RANK = 1
ROSTER = RosterView(
    job_id="j",
    round=1,
    world_size=1,
    members=[MemberAddress(rank=0, member_id="m0", host="127.0.0.1", port=4000, hostname="h")],
)
#: The member's own events a program would forge, as JSON objects.
FORGED: list[dict[str, object]] = [
    Failed(phase="program", rank=0, error="E", message="forged", exit_code=3).wire(),
    Done(rank=0, roster=ROSTER, result={"model_path": "/etc/shadow"}).wire(),
    Phase(phase="cleaner", rank=0).wire(),
    {"event": "round", "rank": 0, "round": 9, "rounds": 10, "metrics": {"x": 1.0}},
    {"event": "step", "rank": 0, "clock": 9, "target": 10},
    {"event": "exit", "exit_code": 0},
]
#: Every way a reader might split a member's output: ours (`\n` only) and Python's.
READERS = {
    "split_lines": lambda data: [line.decode(errors="replace") for line in split_lines(data)],
    "bytes.splitlines": lambda data: [line.decode(errors="replace") for line in data.splitlines()],
    "str.splitlines": lambda data: data.decode(errors="replace").splitlines(),
}


def read_back(data: bytes) -> list[object]:
    """Every event any reader finds in what the member wrote (None: a plain line)."""
    return [parse_event(line) for split in READERS.values() for line in split(data)]


def assert_never_the_members(data: bytes, stream: str) -> None:
    for event in read_back(data):
        if event is None or isinstance(event, Output):
            continue
        assert stream == "stdout" and isinstance(event, Report) and event.rank == RANK, event


def escaped(text: str, which: list[bool]) -> str:
    """`text` as a JSON string body with the chosen characters spelt `\\uXXXX`."""
    return "".join(
        f"\\u{ord(c):04x}" if pick else json.dumps(c)[1:-1]
        for c, pick in zip(text, which + [False] * len(text), strict=False)
    )


@st.composite
def forged_lines(draw: st.DrawFn) -> str:
    """A forged event, its keys and values spelt any way JSON allows, after any prefix
    and any separator, with any padding."""
    fields = draw(st.sampled_from(FORGED))
    parts = []
    for key, value in fields.items():
        spelt = escaped(key, draw(st.lists(st.booleans(), max_size=len(key))))
        if isinstance(value, str):
            value_text = '"' + escaped(value, draw(st.lists(st.booleans(), max_size=8))) + '"'
        else:
            value_text = json.dumps(value)
        space = draw(st.sampled_from(["", " ", "\t"]))
        parts.append(f'"{spelt}"{space}:{value_text}')
    obj = "{" + ",".join(parts) + "}"
    pad = st.text(alphabet=" \t\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u2028\u2029\u3000", max_size=3)
    before = draw(st.sampled_from(["", "hello", "50%|####", "\ufeff"]))
    cut = draw(st.sampled_from(["", *SEPARATORS, "\r\r", " "]))
    return before + cut + draw(pad) + obj + draw(pad)


@settings(max_examples=400, deadline=None)
@given(line=forged_lines(), stream=st.sampled_from(["stdout", "stderr"]))
@example(line='hello\r{"event": "failed", "phase": "program", "rank": 0, "error": "E", '
         '"message": "m", "exit_code": 3}', stream="stdout")  # fmt: skip
@example(line='{"\\u0065vent": "done", "rank": 0, "roster": {"job_id": "j", "round": 1, '
         '"world_size": 1, "members": []}, "result": {"model_path": "/etc/shadow"}}',
         stream="stdout")  # fmt: skip
def test_every_variant_of_a_forged_event_is_wrapped_as_output(line: str, stream: str) -> None:
    data, target = relayed(line.encode(), stream, RANK)  # type: ignore[arg-type]
    assert data.endswith(b"\n") and data.count(b"\n") == 1  # one line, whoever splits
    assert_never_the_members(data, stream)
    for split in READERS.values():
        assert len(split(data)) == 1, split(data)  # no reader finds a second line
    # Every part a reader splitting at any separator would see as a line starting with
    # the forged object: the whole line is wrapped, shown as it was (made visible).
    parts = re.split(f"[{re.escape(SEPARATORS)}]", line)
    if any(part.strip().startswith("{") for part in parts):
        event = parse_event(data)
        assert target == "stdout" and isinstance(event, Output), (line, data)
        assert event.line == neutralise(line) and event.stream == stream


@settings(max_examples=300, deadline=None)
@given(line=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_no_line_at_all_becomes_the_members_event(line: bytes) -> None:
    line = line.replace(b"\n", b"")
    for stream in ("stdout", "stderr"):
        data, _ = relayed(line, stream, RANK)  # type: ignore[arg-type]
        assert data.count(b"\n") == 1 and data.endswith(b"\n")
        for split in READERS.values():
            assert len(split(data)) == 1
        assert_never_the_members(data, stream)


def test_both_bypasses_of_the_audit_are_wrapped_and_shown_as_they_were() -> None:
    failed = json.dumps(FORGED[0])
    data, stream = relayed(f"hello\r{failed}".encode(), "stdout", RANK)
    event = parse_event(data)  # wrapped, its `\r` only shown
    assert stream == "stdout" and isinstance(event, Output), data
    assert event.line == f"hello\u240d{failed}"
    assert all(isinstance(e, Output) for e in read_back(data))

    spelt = json.dumps(FORGED[1]).replace('"event"', '"\\u0065vent"', 1)
    assert '"event"' not in spelt
    data, stream = relayed(spelt.encode(), "stdout", RANK)
    event = parse_event(data)
    assert stream == "stdout" and isinstance(event, Output) and event.line == spelt


def test_a_report_however_spelt_is_the_members_rank_and_only_on_stdout() -> None:
    report = '{"\\u0065vent": "report", "rank": 9, "step": 2}'
    event = parse_event(relayed(report.encode(), "stdout", RANK)[0])
    assert isinstance(event, Report) and event.rank == RANK and event.step == 2
    assert isinstance(parse_event(relayed(report.encode(), "stderr", RANK)[0]), Output)


def test_plain_lines_and_objects_naming_no_event_pass_as_they_are() -> None:
    assert relayed(b"epoch 1 done", "stderr", 0) == (b"epoch 1 done\n", "stderr")
    assert relayed(b'{"level": "info"}', "stdout", 0) == (b'{"level": "info"}\n', "stdout")
    assert relayed(b"line\r", "stdout", 0) == (b"line\n", "stdout")  # a CRLF line end
    # What is judged is what is written: bad UTF-8 is replaced, never passed on raw.
    assert relayed(b"\xff{not utf-8", "stdout", 0) == ("\ufffd{not utf-8\n".encode(), "stdout")


def test_every_separator_but_newline_is_shown_never_a_line_end() -> None:
    for separator in SEPARATORS:
        text = neutralise(f"a{separator}b")
        assert len(text) == 3 and text.splitlines() == [text], repr(separator)
    assert split_lines(b"a\rb\nc\x0bd\n") == [b"a\rb", b"c\x0bd"]
    assert split_lines(b"a\nb") == [b"a", b"b"] and split_lines(b"") == []


def test_claims_are_decided_on_the_parsed_object() -> None:
    assert claims_event('{"\\u0065vent": "x"}') and claims_event(' {"event": 1}')
    assert claims_event('{"event": "done", "broken') and claims_event("{[[[" * 2000)
    assert not claims_event('{"level": "info", "msg": "event"}')
    assert not claims_event('hello {"event": "done"}')
    assert claims_event('hello\r{"event": "done"}') and claims_event('x\u2028 {"\\u0065vent": 1}')
