"""A `command` job's program output, passed on by its member so the program cannot speak
as the member.

Launchers read a member's events from its output (stdout and stderr end up in one
log for most of them), and the program's output used to be the member's own. So the
member reads the program's stdout and stderr itself, line by line, and writes:

- a plain line as it is, on the same stream (what humans and `coordinator run` see);
- a valid `report` line on stdout (`events.PROGRAM_EVENTS`), re-emitted under the
  member's rank: how the program reports its progress and metrics to the service;
- any other line that claims to be an event (a JSON object naming an `event`: a
  forged `done`, `failed` or `phase`, or one malformed) wrapped as an `output`
  event on stdout: shown, never acted on.

Lines end at `\n` only. Whether a line claims to be an event is decided on the
parsed JSON object of each part a reader splitting at `\r` or another separator would
see (`events.claims_event`): `hello\r{"event": ...}` and a key spelt `"\\u0065vent"`
are wrapped like `{"event": ...}`. What is written is the line decoded (bad UTF-8
replaced) with every separator made visible (`events.neutralise`), so no reader ever
finds a second line inside one.

Every line written ends with a newline (a program's last unterminated line too), so
the member's own next event always starts a line; a line longer than `MAX_CHUNK`
is passed on in pieces, each judged alone.
"""

from __future__ import annotations

import threading
from typing import IO, Any, Literal

from coordinator.events import (
    MAX_LINE_BYTES,
    PROGRAM_EVENTS,
    Output,
    claims_event,
    neutralise,
    parse_event,
    write_raw,
)

MAX_CHUNK = 64 * 1024  # bytes of one line read at a time
MAX_ERROR_LINE = 200  # characters of the program's last stderr line kept for its failure
Stream = Literal["stdout", "stderr"]


def relayed(line: bytes, stream: Stream, rank: int | None) -> tuple[bytes, Stream]:
    """What the member writes for one line (or piece) of its program's output, and on
    which of its streams (pure; `line` without its newline)."""
    decoded = line.decode(errors="replace")
    text = neutralise(decoded)  # what is shown, whichever way it goes
    if not claims_event(decoded):
        return text.encode() + b"\n", stream
    event = parse_event(decoded) if stream == "stdout" else None
    if event is not None and event.event in PROGRAM_EVENTS:
        own = event.model_copy(update={"rank": rank})
        return own.to_line().encode() + b"\n", "stdout"
    wrapped = Output(stream=stream, line=text[:MAX_LINE_BYTES])
    return wrapped.to_line().encode() + b"\n", "stdout"


class Relay:
    """Threads passing the program's `stdout` and `stderr` pipes on (see the module)."""

    def __init__(
        self, pipes: list[tuple[IO[bytes], Stream]], rank: int | None, out: Any, err: Any
    ) -> None:
        """`pipes`: each pipe with the stream its lines count as."""
        self.rank = rank
        #: The program's last non-blank stderr line, shown: a failure's likeliest cause
        #: (a Python traceback's last line names the exception).
        self.last_error = ""
        self._targets: dict[Stream, Any] = {"stdout": out, "stderr": err}
        self._threads = [
            threading.Thread(target=self._pass_on, args=(pipe, stream), daemon=True)
            for pipe, stream in pipes
        ]
        for thread in self._threads:
            thread.start()

    def _pass_on(self, pipe: IO[bytes], stream: Stream) -> None:
        with pipe:
            while chunk := pipe.readline(MAX_CHUNK):
                data, target = relayed(chunk.removesuffix(b"\n"), stream, self.rank)
                write_raw(data, self._targets[target])
                if target == "stderr":  # (only plain stderr lines stay on stderr)
                    shown = data.decode(errors="replace").strip()
                    self.last_error = shown[:MAX_ERROR_LINE] or self.last_error

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for the pipes' last lines (once the program ended:
        a grandchild that kept a pipe open is stopped with the group)."""
        for thread in self._threads:
            thread.join(timeout)
