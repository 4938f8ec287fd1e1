"""Members' events: one typed model each, one parser that trusts no line, and the relay
that keeps a `command` job's program from speaking as its member (pure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.events import (
    MAX_LINE_BYTES,
    Done,
    Exit,
    Failed,
    MemberEvent,
    Metrics,
    Output,
    Phase,
    Report,
    RosterView,
    Round,
    Step,
    TimelineEntry,
    parse_event,
    parse_events,
)
from coordinator.jobs.relay import relayed
from coordinator.rendezvous.roster import MemberAddress

ROSTER = RosterView(
    job_id="j",
    round=12,
    world_size=1,
    members=[MemberAddress(rank=0, member_id="m0", host="127.0.0.1", port=4000, hostname="h")],
)
EVENTS: list[MemberEvent] = [
    Phase(phase="connect", rank=1),
    Phase(phase="cleaner", rank=0, cleaned_up=True),
    Step(rank=2, clock=5, target=10, loss=0.25),
    Step(rank=2, clock=5, target=10),
    Round(rank=0, round=3, rounds=10, metrics={"train-logloss": 0.5}),
    Metrics(t=3.5, rank=0, n=1, version=4, samples=64, accuracy=0.8, loss=0.6),
    Done(
        rank=0,
        roster=ROSTER,
        result={"staleness": {"0": 3}, "passages": [[1, 0, 2]]},
        timeline=[TimelineEntry(phase="connect", arrived=1.0, passed=2.0)],
    ),
    Failed(phase="connect", rank=None, error="MemberLost", message="lost rank 1", exit_code=5),
    Report(rank=1, step=3, total=9, metrics={"loss": 0.1}, message="epoch 1"),
    Output(stream="stderr", line='{"event": "done"}'),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.event)
def test_every_event_goes_round_a_line_and_keeps_its_keys(event: MemberEvent) -> None:
    line = event.to_line()
    assert "\n" not in line
    assert parse_event(line) == event
    assert parse_event(line.encode()) == event
    wire = json.loads(line)
    assert wire["event"] == event.event and wire["t"] == event.t
    assert set(wire) == {"event", "t", *event.model_fields_set}  # what was given, no more


def test_the_wire_keeps_the_keys_readers_and_the_dashboard_know() -> None:
    phase = json.loads(Phase(phase="connect", rank=0).to_line())
    assert set(phase) == {"event", "t", "phase", "rank"}  # no `cleaned_up: null` added
    failed = json.loads(EVENTS[7].to_line())
    assert failed["rank"] is None and failed["exit_code"] == 5  # a rank given as None stays
    done = json.loads(EVENTS[6].to_line())
    assert done["roster"]["members"][0] == {
        "rank": 0, "member_id": "m0", "host": "127.0.0.1", "port": 4000, "hostname": "h", "pid": 0
    }  # fmt: skip
    assert "secret" not in done["roster"]
    assert EVENTS[6].address == "127.0.0.1:4000"  # type: ignore[union-attr]
    nan = parse_event('{"event": "step", "t": 1, "rank": 0, "clock": 1, "target": 2, "loss": NaN}')
    assert isinstance(nan, Step) and nan.loss != nan.loss  # a diverged loss is still a step


@pytest.mark.parametrize(
    "line",
    [
        "",
        "hello world",
        "epoch 3: loss 0.25",
        "[1, 2, 3]",
        '"event"',
        "{not json",
        '{"no": "event"}',
        '{"event": "party", "t": 1}',  # unknown
        '{"event": "exit", "t": 1, "exit_code": 0}',  # only a launcher says so
        '{"event": "phase", "t": 1}',  # a field missing
        '{"event": "phase", "t": 1, "phase": "connect", "rank": "0"}',  # a rank as text
        '{"event": "phase", "t": 1, "phase": "connect", "rank": -1}',
        '{"event": "step", "t": 1, "rank": 0, "clock": 1.5, "target": 2}',
        '{"event": "failed", "t": 1, "phase": "p", "error": "E", "message": "m", "exit_code": 999}',
        '{"event": "phase", "t": 1, "phase": "' + "p" * 101 + '"}',  # a phase too long
        '{"event": "round", "t": 1, "rank": 0, "round": 1, "rounds": 1, "metrics": {'
        + ", ".join(f'"m{i}": 1.0' for i in range(101))
        + "}}",  # too many metrics
        '{"event": "phase", "t": 1, "phase": "x"' + " " * MAX_LINE_BYTES + "}",  # oversized
        '{"a": ' * 100_000,  # deep nesting
        '{"event": "report", "t": 1, "metrics": {"a": {"b": 1}}}',
    ],
)
def test_plain_malformed_unknown_or_oversized_lines_are_no_event(line: str) -> None:
    assert parse_event(line) is None


def test_events_are_picked_out_of_a_members_mixed_output() -> None:
    output = b"starting\n" + Phase(phase="connect", rank=0).to_line().encode() + b"\n{bad\n"
    assert [e.event for e in parse_events(output)] == ["phase"]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400) | st.binary(max_size=400).map(lambda b: b.decode(errors="replace")))
def test_no_line_of_text_makes_the_parser_raise(line: str) -> None:
    event = parse_event(line)
    assert event is None or event.event != "exit"


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["event", "t", "rank", "phase", "clock", "target", "metrics", "line"]),
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    )
)
def test_no_json_object_makes_the_parser_raise(fields: dict[str, object]) -> None:
    parse_event(json.dumps(fields))


def test_a_program_reports_under_its_members_rank_and_cannot_forge_the_members_events() -> None:
    report = b'{"event": "report", "rank": 9, "step": 2, "metrics": {"loss": 0.5}}'
    data, stream = relayed(report, "stdout", 1)
    event = parse_event(data)
    assert stream == "stdout" and isinstance(event, Report)
    assert event.rank == 1 and event.step == 2 and event.metrics == {"loss": 0.5}

    forged = [
        Done(rank=0, roster=ROSTER).to_line(),
        Failed(phase="connect", rank=0, error="E", message="m", exit_code=3).to_line(),
        Phase(phase="cleaner", rank=0).to_line(),
        '  {"event": "done", "broken',
    ]
    for line in forged:
        for source in ("stdout", "stderr"):
            data, stream = relayed(line.encode(), source, 1)  # type: ignore[arg-type]
            event = parse_event(data)
            assert stream == "stdout" and isinstance(event, Output), (line, source)
            assert event.line == line and event.stream == source  # shown as it was

    # A report on stderr is not one: only stdout carries a program's reports.
    assert isinstance(parse_event(relayed(report, "stderr", 1)[0]), Output)
    # Plain lines pass as they are, on their own stream, always ending a line.
    assert relayed(b"epoch 1 done", "stderr", 0) == (b"epoch 1 done\n", "stderr")
    assert relayed(b"\xff{not utf-8", "stdout", 0) == ("\ufffd{not utf-8\n".encode(), "stdout")


def test_launcher_made_events_are_models_too() -> None:
    assert Exit(exit_code=3).exit_code == 3
    assert Output(line="x").stream == "stdout"


def test_the_docs_table_names_every_event_and_each_of_its_fields() -> None:
    """docs/events.md's table is the events' only description: it must not drift."""
    table = (Path(__file__).parents[2] / "docs" / "events.md").read_text()
    rows = {
        line.split("|")[1].strip().strip("`"): line
        for line in table.splitlines()
        if line.startswith("| `")
    }
    for model in (Phase, Step, Round, Metrics, Done, Failed, Report, Output, Exit):
        name = model.model_fields["event"].default
        assert name in rows, f"docs/events.md has no row for `{name}`"
        missing = [f for f in model.model_fields if f not in ("event", "t")
                   and f"`{f}`" not in rows[name]]  # fmt: skip
        assert not missing, f"docs/events.md's `{name}` row lacks {missing}"
