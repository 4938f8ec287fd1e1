"""`coordinator run`'s launcher: a job's members as child processes whose progress it
follows through pipes.

The embedded default: no containers, no cluster, just `coordinator worker`
processes on this machine (the service's local launcher keeps log files instead).
Each worker's JSON progress lines are read from its stdout; its stderr is kept for
the report when it fails. Both are read as bytes and split at `\n` only, as every
reader of members' output splits (`events.split_lines`): text mode's universal
newlines would end a line at a `\r` inside one.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Literal

from coordinator.events import (
    MAX_LINE_BYTES,
    Done,
    Exit,
    Failed,
    MemberEvent,
    Output,
    Phase,
    Report,
    neutralise,
    parse_event,
)
from coordinator.launch import WorkerCommand
from coordinator.launch.local import start_process


@dataclass
class PipedWorker:
    index: int
    process: subprocess.Popen[bytes]
    rank: int | None = None
    phase: str = "starting"
    done: Done | None = None
    failed: Failed | None = None
    stderr: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()


class PipedLauncher:
    """Spawns `n` copies of `command`; `events` yields their progress (and, with `echo`,
    their other output lines as `output` events: a program's)."""

    def __init__(self, n: int, command: WorkerCommand, echo: bool = False) -> None:
        self.echo = echo
        self.events: queue.Queue[tuple[int, MemberEvent]] = queue.Queue()
        self.workers: list[PipedWorker] = []
        try:
            for index in range(n):
                process = start_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                worker = PipedWorker(index, process)
                self.workers.append(worker)
                threading.Thread(target=self._read_events, args=(worker,), daemon=True).start()
                threading.Thread(
                    target=self._read_stderr, args=(worker, process.stderr), daemon=True
                ).start()
        except BaseException:
            self.stop()
            raise

    def _read_events(self, worker: PipedWorker) -> None:
        assert worker.process.stdout is not None
        for line in _lines(worker.process.stdout):
            event = parse_event(line)
            if event is None:  # plain output, or a line that only looks like an event
                self._output(worker, "stdout", line)
                continue
            if isinstance(event, Output):  # a program's line its member wrapped: shown only
                if self.echo:
                    self.events.put((worker.index, event))
                continue
            rank = getattr(event, "rank", None)
            if rank is not None and not isinstance(event, Report):
                worker.rank = rank
            if isinstance(event, Phase):
                worker.phase = event.phase
            elif isinstance(event, Done):
                worker.done = event
            elif isinstance(event, Failed):
                worker.failed = event
            self.events.put((worker.index, event))
        worker.process.wait()
        self.events.put((worker.index, Exit(exit_code=worker.process.returncode)))

    def _output(self, worker: PipedWorker, stream: Literal["stdout", "stderr"], line: str) -> None:
        if self.echo:
            event = Output(stream=stream, line=line[:MAX_LINE_BYTES])
            self.events.put((worker.index, event))

    def _read_stderr(self, worker: PipedWorker, stream: IO[bytes] | None) -> None:
        assert stream is not None
        for line in _lines(stream):
            worker.stderr.append(line)
            if len(worker.stderr) > 2000:  # a program may write without end: keep the last
                del worker.stderr[:1000]
            self._output(worker, "stderr", line)

    def running(self) -> int:
        return sum(1 for w in self.workers if w.exit_code is None)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every worker still running (they leave cleanly), SIGKILL after `grace`."""
        for worker in self.workers:
            if worker.exit_code is None:
                worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for worker in self.workers:
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()


def _lines(stream: IO[bytes]) -> Iterator[str]:
    """The lines of a member's stream, split at `\n` only (binary reads split nowhere
    else), decoded and with no other line end left in them (`events.neutralise`)."""
    for raw in stream:
        yield neutralise(raw.removesuffix(b"\n").decode(errors="replace"))
