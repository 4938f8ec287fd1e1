"""The user's program as a process group the member owns: start, signal, stop, reap.

The program runs under `reaper.py` (the group's leader), which kills the whole
group if the member dies, however it dies. Here is the member's side: the
group's signals, and stopping it with a grace (SIGTERM, then SIGKILL) so that no
process of the program outlives the member, grandchildren included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from coordinator.events import REPORTS_FD_ENV
from coordinator.jobs.relay import Relay, Stream
from coordinator.jobs.run_as import NPROC_ENV

REAPER = Path(__file__).with_name("reaper.py")
_POLL = 0.02  # seconds between checks that a stopped group is empty
_DRAIN = 5.0  # seconds to wait for the program's last output lines once the group is empty


def _nproc_env(user: int | None, nproc: int | None) -> dict[str, str]:
    """What tells the reaper the program's RLIMIT_NPROC (only under a uid of its own)."""
    return {NPROC_ENV: str(nproc)} if user is not None and nproc is not None else {}


class ProgramGroup:
    """One running program (under its reaper), in a process group of its own."""

    def __init__(
        self,
        program: Sequence[str],
        env: Mapping[str, str],
        cwd: Path | None = None,
        rank: int | None = None,
        user: int | None = None,
        nproc: int | None = None,
    ) -> None:
        """`user`: the uid (and group) the program runs under, none of ours kept
        (`coordinator.jobs.run_as`): the reaper drops to it as it starts the program, and
        stays ours, so that it can still stop the group. None: ours. `nproc`: the
        RLIMIT_NPROC it sets as it drops to `user` (all that uid's processes are the job's)."""
        # The reports of `coordinator.context()` come on a pipe of their own: written from
        # a timer thread into stdout, one could land inside a line the program was printing.
        reports, reports_end = os.pipe()
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    str(REAPER),
                    str(os.getpid()),
                    str(user or "-"),
                    *program,
                ],
                env={**env, REPORTS_FD_ENV: str(reports_end), **_nproc_env(user, nproc)},
                cwd=cwd,
                stdout=subprocess.PIPE,  # passed on by the member (relay.py): never its events
                stderr=subprocess.PIPE,
                pass_fds=(reports_end,),
                start_new_session=True,  # its own group: signals reach the whole program
            )
        except BaseException:
            os.close(reports)
            raise
        finally:
            os.close(reports_end)
        self.pgid = self.process.pid
        assert self.process.stdout is not None and self.process.stderr is not None
        pipes: list[tuple[IO[bytes], Stream]] = [
            (self.process.stdout, "stdout"),
            (self.process.stderr, "stderr"),
            (os.fdopen(reports, "rb"), "stdout"),  # judged as stdout lines are
        ]
        self.relay = Relay(pipes, rank, sys.stdout, sys.stderr)

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def send(self, signum: int) -> bool:
        """Send `signum` to every process of the group; False once the group is empty."""
        try:
            os.killpg(self.pgid, signum)
        except ProcessLookupError:
            return False
        except PermissionError:  # only zombies left, or the id was reused: not ours
            return False
        return True

    def alive(self) -> bool:
        """Whether any process is left in the group (the reaper reaped, or not yet)."""
        self.process.poll()
        return self.send(0)

    def stop(self, grace: float, signum: int = signal.SIGTERM) -> None:
        """`signum` to the group, SIGKILL to whatever is left after `grace` seconds; returns
        once the reaper is reaped and the group is empty (or only zombies are left)."""
        if not self.send(signum):
            self.process.wait()
            self.relay.join(_DRAIN)
            return
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            time.sleep(_POLL)
        self.kill()
        self.relay.join(_DRAIN)  # the program's last lines before the member's own

    def kill(self) -> None:
        self.send(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5.0)
