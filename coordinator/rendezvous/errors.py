"""What can go wrong in a rendezvous, each with the exit code the CLI uses for it."""

from __future__ import annotations


class RendezvousError(RuntimeError):
    """Base of every rendezvous failure; `exit_code` is the worker's exit status."""

    exit_code = 1


class JobFull(RendezvousError):
    """The job already has all its members; this one is one too many."""

    exit_code = 4


class MemberLost(RendezvousError):
    """Another member died, lost etcd, or failed, while this one waited for it."""

    exit_code = 5

    def __init__(self, rank: int, phase: str, reason: str) -> None:
        self.rank, self.phase, self.reason = rank, phase, reason
        super().__init__(f"member rank {rank} was lost during phase '{phase}': {reason}")


class RendezvousTimeout(RendezvousError):
    """A wait ran past its deadline; names the members that never arrived."""

    exit_code = 6

    def __init__(self, phase: str, timeout: float, missing: list[int] | str) -> None:
        self.phase, self.missing = phase, missing
        who = missing if isinstance(missing, str) else "ranks " + ", ".join(map(str, missing))
        super().__init__(f"phase '{phase}' timed out after {timeout:g}s waiting for {who}")


class SessionLost(RendezvousError):
    """This member's own lease is gone: it stops rather than act on a stale view."""

    exit_code = 7


class Unreachable(RendezvousError):
    """The leader could not open a connection to a member's published endpoint."""

    exit_code = 8


class ProgramFailed(RendezvousError):
    """The user's program (the `command` kind) ended with a non-zero status or a signal."""

    exit_code = 9

    def __init__(self, rank: int, status: str) -> None:
        self.rank, self.status = rank, status
        super().__init__(f"rank {rank}: the program {status}")
