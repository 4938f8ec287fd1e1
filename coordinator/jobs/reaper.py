"""Stand between a member and its program so no process of the program outlives the member.

Run as a script (standard library only, `python -I -S reaper.py MEMBER_PID UID PROGRAM...`,
UID `-` for the member's own)
by the `command` kind, as the leader of a new process group. It asks Linux to
send it SIGTERM when the member dies (PR_SET_PDEATHSIG: even a SIGKILLed member
triggers it), starts the program in the same group, and waits for it:

- when the program ends, the reaper ends the same way (exit code, or the same signal:
  SIGKILL too, so a program killed reads as killed whatever it printed before);
- on a signal while the member lives, nothing: the member signalled the whole
  group, so the program got it too, and the member decides what follows;
- on a signal once the member is gone, SIGKILL to the whole group (itself, the
  program and every grandchild that stayed in the group).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
from types import FrameType

NPROC_ENV = "COORDINATOR_PROGRAM_NPROC"  # coordinator.jobs.run_as.NPROC_ENV (stdlib only here)
PR_SET_PDEATHSIG = 1
EXIT_CANNOT_START = 127


def _orphaned(member: int) -> bool:
    return os.getppid() != member


def main(argv: list[str]) -> int:
    member, program = int(argv[1]), argv[3:]
    user = None if argv[2] == "-" else int(argv[2])

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if _orphaned(member):
            os.killpg(os.getpgrp(), signal.SIGKILL)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if _orphaned(member):  # the member died before the request took effect
        return EXIT_CANNOT_START
    if user is not None:
        pid = _start_as(user, program)
    else:
        try:  # the program starts with default dispositions, whatever ours are
            pid = os.posix_spawnp(
                program[0],
                program,
                os.environ,
                setsigdef=(signal.SIGTERM, signal.SIGINT, signal.SIGHUP),
            )
        except OSError as exc:
            print(f"cannot start {program[0]!r}: {exc.strerror}", file=sys.stderr, flush=True)
            return EXIT_CANNOT_START
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum != signal.SIGKILL:  # SIGKILL's disposition cannot be set (it raised, and
            signal.signal(signum, signal.SIG_DFL)  # a killed program read as exit code 1)
        os.kill(os.getpid(), signum)
    return os.waitstatus_to_exitcode(status)


def _start_as(user: int, program: list[str]) -> int:
    """Fork, drop to uid and gid `user` with no other groups (and the uid's RLIMIT_NPROC
    where the member was given one: its processes are all the job's), and exec the
    program."""
    nproc = os.environ.pop(NPROC_ENV, "")
    pid = os.fork()
    if pid:
        return pid
    try:
        if nproc:
            resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc), int(nproc)))
        os.setgroups([])
        os.setgid(user)
        os.setuid(user)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        os.execvpe(program[0], program, os.environ)
    except OSError as exc:
        print(f"cannot start {program[0]!r} as uid {user}: {exc.strerror}", file=sys.stderr)
    finally:
        os._exit(EXIT_CANNOT_START)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
