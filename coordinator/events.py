"""A worker's progress as JSON lines on stdout: what launchers and humans follow.

One typed model per event, told apart by the `event` key; `emit` writes one as a
line, `parse_event` reads one back. Lines come from member processes (and,
through the member, from a `command` job's program), so reading trusts nothing:
a line that is too long, not JSON, of an unknown event or with a field of the
wrong type or size is no event (`None`), as is plain program output.

docs/events.md has the table of events: who prints each and its fields (the
models below are the contract; that table is their only description).

A program may report `report` events only (`PROGRAM_EVENTS`): its member relays
each line of the program's output (`coordinator.jobs.relay`), re-emitting a valid
report under the member's own rank and wrapping any other line that claims to be
an event as `output`, so a program cannot forge its member's phase or outcome.

Lines end at `\n` only, for every reader (`split_lines`): `\r` and the other
characters some reader or terminal takes for a line break (`SEPARATORS`: Python's
`str.splitlines`, universal newlines) are never line ends, and the relay replaces them
(`neutralise`) so that no reader, however it splits, finds a second line inside one.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import from_json

from coordinator.rendezvous.roster import MemberAddress

#: The longest line read as an event (a `done` line carries the member's result).
MAX_LINE_BYTES = 4 * 1024 * 1024
#: The most entries a `report`'s or `round`'s metrics may hold.
MAX_METRICS = 100

Name = Annotated[str, Field(max_length=100)]
Text = Annotated[str, Field(max_length=4000)]
Rank = Annotated[int, Field(ge=0, le=1_000_000)]
Count = Annotated[int, Field(ge=0)]
MetricMap = Annotated[dict[Name, float], Field(max_length=MAX_METRICS)]


class _Event(BaseModel):
    """What every event has: its kind and when (Unix time; `metrics`: seconds since
    training began)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    t: float = Field(default_factory=time.time)

    def wire(self) -> dict[str, Any]:
        """The event as its JSON object: `event`, `t` and the fields the emitter gave (or
        the line held); an optional field left out stays out, as on the wire before."""
        given = self.model_fields_set
        fields = {k: v for k, v in self.model_dump().items() if k in given}  # nested: whole
        return {"event": getattr(self, "event"), "t": self.t, **fields}  # noqa: B009

    def to_line(self) -> str:
        """The event as one JSON line."""
        return json.dumps(self.wire())


class Phase(_Event):
    event: Literal["phase"] = "phase"
    phase: Name
    rank: Rank | None = None
    cleaned_up: bool | None = None  # `cleaner`: whether this member deleted the job's keys


class Step(_Event):
    event: Literal["step"] = "step"
    rank: Rank
    clock: Count
    target: Count
    loss: float | None = None


class Round(_Event):
    event: Literal["round"] = "round"
    rank: Rank
    round: Count
    rounds: Count
    metrics: MetricMap = Field(default_factory=dict)


class Metrics(_Event):
    event: Literal["metrics"] = "metrics"
    rank: Rank = 0
    n: Count = 0
    version: Count | None = None
    samples: Count | None = None
    accuracy: float | None = None
    loss: float | None = None


class TimelineEntry(BaseModel):
    """When a member entered a phase's wait and when it passed (wall clock)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    phase: Name
    arrived: float
    passed: float


class RosterView(BaseModel):
    """The roster as events carry it: never the round's secret."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    job_id: Name
    round: int
    world_size: Annotated[int, Field(ge=1)]
    members: Annotated[list[MemberAddress], Field(max_length=100_000)]


class Done(_Event):
    event: Literal["done"] = "done"
    rank: Rank
    roster: RosterView
    result: dict[Name, Any] = Field(default_factory=dict)  # the job's own; bounded by the line
    timeline: Annotated[list[TimelineEntry], Field(max_length=1000)] = Field(default_factory=list)

    @property
    def address(self) -> str | None:
        """This member's own `host:port` from the roster, if it names this rank."""
        for entry in self.roster.members:
            if entry.rank == self.rank:
                return f"{entry.host}:{entry.port}"
        return None


class Failed(_Event):
    event: Literal["failed"] = "failed"
    phase: Name
    rank: Rank | None = None
    error: Name
    message: Text
    exit_code: Annotated[int, Field(ge=-255, le=255)]
    culprit: Rank | None = None  # whose program failed first (ProgramFailed): the cause


class Report(_Event):
    """What a `command` job's program reports of itself (issue 19's in-job API)."""

    event: Literal["report"] = "report"
    rank: Rank | None = None  # set by the member that relays it, never by the program
    step: Count | None = None
    total: Count | None = None
    metrics: MetricMap = Field(default_factory=dict)
    message: Text | None = None


class Output(_Event):
    """A line of a program's output, as a line: shown, never acted on."""

    event: Literal["output"] = "output"
    stream: Literal["stdout", "stderr"] = "stdout"
    line: Annotated[str, Field(max_length=MAX_LINE_BYTES)]


class Exit(_Event):
    """A member process ended (`coordinator run`'s launcher says so; members never do)."""

    event: Literal["exit"] = "exit"
    exit_code: int | None


MemberEvent = Annotated[
    Phase | Step | Round | Metrics | Done | Failed | Report | Output | Exit,
    Field(discriminator="event"),
]
#: The events a `command` job's program may print of itself (see the module docstring).
PROGRAM_EVENTS = frozenset({"report"})
#: The pipe (a file descriptor number) a `command` member gives its program for these
#: events, apart from its stdout; `coordinator.context()` writes its reports there.
REPORTS_FD_ENV = "COORDINATOR_REPORTS_FD"
#: The events that only a launcher makes: a member's line claiming one is not read.
LAUNCHER_EVENTS = frozenset({"exit"})

_ADAPTER: TypeAdapter[MemberEvent] = TypeAdapter(MemberEvent)
_WRITE = threading.Lock()  # whole lines: the member's events and its program's relayed lines


def parse_event(line: str | bytes) -> MemberEvent | None:
    """The event a line holds, or None: plain output, or a line that is too long, not a
    JSON object, of an unknown or launcher-only event, or with a bad field."""
    if len(line) > MAX_LINE_BYTES:
        return None
    text = line.strip()
    if not text.startswith(b"{" if isinstance(text, bytes) else "{"):
        return None
    try:
        event = _ADAPTER.validate_json(text)
    except (ValidationError, ValueError, RecursionError):
        return None
    return None if event.event in LAUNCHER_EVENTS else event


def member_own_line(line: str) -> bool:
    """Whether a line of a member's output is one of its own events (not a line of its
    program's, which the member passed on plain or wrapped as `output`)."""
    event = parse_event(line)
    return event is not None and not isinstance(event, Output)


def parse_events(output: bytes) -> list[MemberEvent]:
    """The events in a member's output (whole lines; anything else is skipped)."""
    return [e for line in split_lines(output) if (e := parse_event(line)) is not None]


#: What some reader takes for a line break besides `\n`: `\r` (universal newlines, a
#: terminal's carriage return) and the rest of `str.splitlines`' breaks.
SEPARATORS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
#: Each separator as a visible sign of itself (Unicode's control pictures): shown, never
#: a line's end.
_NEUTRAL = str.maketrans(
    {
        "\r": "\u240d",
        "\x0b": "\u240b",
        "\x0c": "\u240c",
        "\x1c": "\u241c",
        "\x1d": "\u241d",
        "\x1e": "\u241e",
        "\x85": "\u2424",
        "\u2028": "\u2424",
        "\u2029": "\u2424",
    }
)


_ANY_BREAK = re.compile(f"[{re.escape(SEPARATORS)}]")


def split_lines(output: bytes) -> list[bytes]:
    """The lines of `output`, split at `\n` only (without it; a last line without one
    too): how every reader of members' output splits it, so all see the same lines."""
    lines = output.split(b"\n")
    return lines[:-1] if lines[-1] == b"" else lines


def neutralise(line: str) -> str:
    """`line` with every separator but `\n` replaced by a visible sign, so no reader
    (whatever it splits on) nor terminal finds a line inside it; one `\r` ending the
    line (a CRLF line end) is dropped."""
    line = line.removesuffix("\r")
    return line if _ANY_BREAK.search(line) is None else line.translate(_NEUTRAL)


def claims_event(line: str) -> bool:
    """Whether some reader might take `line`, or a part of it that a reader splitting at
    a separator would see as a line, for an event: what a member must not pass on from
    its program as it is. Decided on the parsed object, as readers decide (so a key
    spelt `"\\u0065vent"` is `event`): a JSON object naming an `event`, or a part that
    starts like an object and does not parse (no reader reads it; wrapped all the
    same)."""
    if "{" not in line:
        return False  # no part of it can start like an object
    return any(_claims(part) for part in _ANY_BREAK.split(line))


def _claims(part: str) -> bool:
    text = part.strip()
    if not text.startswith("{"):
        return False  # `parse_event` reads nothing else (it strips no more than this)
    try:
        parsed = from_json(text)
    except (ValueError, RecursionError):
        return True
    return not isinstance(parsed, dict) or "event" in parsed


def emit(event: _Event) -> None:
    """Print `event` as one whole line on stdout, at once."""
    write_line(event.to_line())


def write_line(line: str, stream: Any = None) -> None:
    """Write one line to `stream` (stdout) in one go, never interleaved with another."""
    write_raw((line + "\n").encode(), stream)


def write_raw(data: bytes, stream: Any = None) -> None:
    """Write whole lines (`data` ends with a newline) to `stream` (stdout) in one go."""
    out = stream if stream is not None else sys.stdout
    with _WRITE:
        out.flush()  # what was printed before, first
        binary = getattr(out, "buffer", None)
        if binary is not None:
            binary.write(data)
            binary.flush()
        else:
            out.write(data.decode(errors="replace"))
            out.flush()
