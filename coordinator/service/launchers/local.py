"""Members as local processes: the service's embedded default.

Each member is `python -m coordinator worker ...` in a session of its own, its
stdout and stderr appended to one log file
(`<logs>/<job>-<uid>/attempt-<n>/member-<i>.log`), so it outlives the service that
started it and writes to nothing that dies with it (a pipe would). A pidfile
beside the log, written at once, makes `start` idempotent and lets a restarted
service find a member its predecessor started but never recorded. A pid is
trusted only with its start time, so a reused pid is never taken for a member.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from coordinator.service.launchers import NOTHING, VANISHED, Launch, Reservation
from coordinator.service.model import Member

# Run first in a member that must die with its parent: asks the kernel for SIGKILL when
# the thread that started it ends (prctl PR_SET_PDEATHSIG = 1, kept across exec), leaves
# if that parent is already gone, then becomes the worker. A fresh interpreter does this,
# not code run between fork and exec: there it would share the parent's gRPC state,
# whose fork handlers abort the child now and then.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


class LocalLauncher:
    def __init__(self, logs: Path, die_with_parent: bool = False) -> None:
        """`die_with_parent`: members are killed when the thread that started them ends
        (an agent's members die with it); the service's members outlive it instead."""
        self.logs = logs
        self.die_with_parent = die_with_parent
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # pid -> our own child

    def folder(self, run_id: str, attempt: int) -> Path:
        return self.logs / run_id / f"attempt-{attempt}"

    def reserve(self, launch: Launch) -> Reservation:
        return NOTHING  # the service's --max-workers is the limit

    def start(self, launch: Launch, index: int) -> Member:
        folder = self.folder(launch.run_id, launch.attempt)
        folder.mkdir(parents=True, exist_ok=True)
        pidfile = folder / f"member-{index}.pid"
        log = folder / f"member-{index}.log"
        if pidfile.exists():  # started before: never start it twice
            return Member(index=index, log=str(log), **json.loads(pidfile.read_text()))
        with open(log, "ab") as output:
            command = [sys.executable, "-m", "coordinator", "worker", *launch.worker_args]
            if self.die_with_parent:
                command = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command[1:]]
            process = subprocess.Popen(
                command,
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group, and no terminal signals
                # Port 0: members on one host must not share the image's fixed port.
                env={**os.environ, "PYTHONUNBUFFERED": "1", "COORDINATOR_PORT": "0"},
            )
        self._children[process.pid] = process
        identity = {"pid": process.pid, "started": _start_time(process.pid)}
        partial = pidfile.with_suffix(".partial")
        partial.write_text(json.dumps(identity))
        partial.replace(pidfile)
        return Member(index=index, log=str(log), **identity)

    def exit_code(self, member: Member) -> int | None:
        assert member.pid is not None
        child = self._children.get(member.pid)
        if child is not None:
            code = child.poll()
            if code is None:
                return None
            del self._children[member.pid]
            return 128 - code if code < 0 else code  # killed by signal n: 128 + n, as shells say
        if self._alive(member):
            return None
        return _last_word(self.output(member, 0))

    def terminate(self, member: Member) -> None:
        self._signal(member, signal.SIGTERM)

    def kill(self, member: Member) -> None:
        self._signal(member, signal.SIGKILL)

    def output(self, member: Member, offset: int) -> bytes:
        if member.log is None:
            return b""
        try:
            with open(member.log, "rb") as log:
                log.seek(offset)
                return log.read()
        except FileNotFoundError:
            return b""

    def remove(self, run_id: str) -> int:
        folder = self.logs / run_id
        logs = len(list(folder.glob("*/member-*.log")))
        shutil.rmtree(folder, ignore_errors=True)
        return logs

    def _signal(self, member: Member, signum: int) -> None:
        if member.pid is not None and self._alive(member):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(member.pid, signum)

    def _alive(self, member: Member) -> bool:
        """The member's own process still runs (not a reused pid, not a zombie)."""
        assert member.pid is not None
        try:
            process = psutil.Process(member.pid)
            same = member.started is None or abs(process.create_time() - member.started) < 0.05
            return same and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:  # it ended already: its exit code says how
        return None


def _last_word(output: bytes) -> int:
    """The exit code a member's last event gave (`failed` carries it; `done` is 0)."""
    for line in reversed(output.splitlines()):
        if line.startswith(b"{"):
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "failed":
                    return int(event.get("exit_code", VANISHED))
                if event.get("event") == "done":
                    return 0
    return VANISHED
