"""What can go wrong in a rendezvous, each with the exit code the CLI uses for it."""

from __future__ import annotations

from typing import Any


class RendezvousError(RuntimeError):
    """Base of every rendezvous failure; `exit_code` is the worker's exit status."""

    exit_code = 1

    def __init_subclass__(cls, *, exit_code: int, **kwargs: Any) -> None:
        """Each kind of failure must name its exit status (`exit_code=N` in its class line)."""
        super().__init_subclass__(**kwargs)
        cls.exit_code = exit_code


class JobFull(RendezvousError, exit_code=4):
    """The job already has all its members; this one is one too many."""


class MemberLost(RendezvousError, exit_code=5):
    """Another member died, lost etcd, or failed, while this one waited for it."""

    def __init__(self, rank: int, phase: str, reason: str) -> None:
        self.rank, self.phase, self.reason = rank, phase, reason
        super().__init__(f"member rank {rank} was lost during phase '{phase}': {reason}")


class RendezvousTimeout(RendezvousError, exit_code=6):
    """A wait ran past its deadline; names the members that never arrived."""

    def __init__(self, phase: str, timeout: float, missing: list[int] | str) -> None:
        self.phase, self.missing = phase, missing
        who = missing if isinstance(missing, str) else "ranks " + ", ".join(map(str, missing))
        super().__init__(f"phase '{phase}' timed out after {timeout:g}s waiting for {who}")


class SessionLost(RendezvousError, exit_code=7):
    """This member's own lease is gone: it stops rather than act on a stale view."""


class Unreachable(RendezvousError, exit_code=8):
    """The leader could not open a connection to a member's published endpoint."""


class ProgramFailed(RendezvousError, exit_code=9):
    """The user's program (the `command` kind) ended with a non-zero status or a signal."""

    def __init__(self, rank: int, status: str) -> None:
        self.rank, self.status = rank, status
        super().__init__(f"rank {rank}: the program {status}")
