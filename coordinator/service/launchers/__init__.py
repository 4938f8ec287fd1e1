"""How the service starts, watches and stops a job's members: one launcher per kind.

A launcher starts member `index` of attempt `attempt` of a job, idempotently:
asked again for the same member (a new leader finishing its predecessor's
launch), it returns the member already running instead of a second one. What
it returns is recorded in the job's record in etcd (a pid and its start time,
or a container id), so any replica can later find, follow and stop the member,
including one started by a service process that has since died.
"""

from __future__ import annotations

from typing import Protocol

from coordinator.service.model import Member

#: The exit code recorded for a member that ended without a word: killed by a
#: signal while not our child, so neither a status nor a last event tells how.
VANISHED = -1


class WorkerLauncher(Protocol):
    def start(self, run_id: str, attempt: int, index: int, worker_args: list[str]) -> Member:
        """Start `coordinator worker <worker_args>` as that member (or find it running)."""
        ...

    def exit_code(self, member: Member) -> int | None:
        """None while the member runs; its exit code once it ended (`VANISHED` if unknown)."""
        ...

    def terminate(self, member: Member) -> None:
        """Ask the member to leave (SIGTERM): it fails its phase cleanly, naming why."""
        ...

    def kill(self, member: Member) -> None: ...

    def output(self, member: Member, offset: int) -> bytes:
        """The member's output (stdout and stderr, interleaved) from byte `offset` on."""
        ...

    def remove(self, run_id: str) -> int:
        """Forget a finished submission: its members' logs or containers; how many."""
        ...
