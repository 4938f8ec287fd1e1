"""How the service starts, watches and stops a job's members: one launcher per kind.

Starting an attempt takes two steps. `reserve` first says whether the attempt
fits now, and returns the etcd writes that take its room (the agents launcher
writes every member's assignment). The reconciler commits them in the same
transaction that moves the job to STARTING, so a job is placed whole or not at
all, and two replicas never both take the same room. (A placement too big for
one transaction is written ahead, and what the reconciler commits is then one
key that lets it run: `chunks`.) Then `start` starts each member not yet
recorded.

A launcher starts member `index` of attempt `attempt` of a job, idempotently:
asked again for the same member (a new leader finishing its predecessor's
launch), it returns the member already running instead of a second one. What
it returns is recorded in the job's record in etcd (a pid and its start time,
or a container id), so any replica can later find, follow and stop the member,
including one started by a service process that has since died.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from coordinator.etcd.txn import Guard, Put
from coordinator.etcd.users import Credentials
from coordinator.launch import WorkerCommand
from coordinator.service.model import JobSpec, Launcher, Member


class LauncherUnavailable(Exception):
    """A launcher asked for cannot work here (no configuration, a bad option)."""


#: The launchers whose members count against the service's own `--max-workers` (they
#: run on its machine, or its container engine); agents and Kubernetes have their own.
OWN_SLOTS = frozenset({Launcher.LOCAL, Launcher.DOCKER})

#: The exit code recorded for a member that ended without a word: killed by a
#: signal while not our child, so neither a status nor a last event tells how.
VANISHED = -1

#: The most bytes of a member's output one `output` call answers.
OUTPUT_CAP = 1024 * 1024


@dataclass(frozen=True)
class Launch:
    """One attempt of a job, as its members are started."""

    run_id: str  # names the submission's members, logs and containers
    attempt: int  # 1, 2, ...
    spec: JobSpec
    command: WorkerCommand  # what every member runs (an agents launcher adds its GPUs)
    # The job's own etcd user (never in `command`: the password is written to a file for
    # each member, see `member_command`). None: the members
    # connect as their launcher does (etcd without auth, or a service that may not make
    # users).
    credentials: Credentials | None = None


def member_command(
    command: WorkerCommand, credentials: Credentials | None, password_file: Path | str
) -> WorkerCommand:
    """`command`, connecting as its job's etcd user with the password in the
    file its launcher wrote (as given without credentials: the member inherits its
    launcher's etcd settings)."""
    if credentials is None:
        return command
    return command.model_copy(
        update={
            "etcd_user": credentials.user,
            "etcd_password_file": str(Path(password_file).absolute()),
        }
    )


@dataclass(frozen=True)
class Reservation:
    """The room an attempt takes, written atomically with the job's move to STARTING."""

    puts: list[Put] = field(default_factory=list)
    # What must still hold: the agents placed on are the ones read, and nobody else
    # placed members on them since.
    guards: list[Guard] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)  # recorded at once (placed members)
    # Undoes what `reserve` wrote ahead of the commit, unless the commit was made (it
    # checks): called when the reservation will not be committed. None: nothing was.
    release: Callable[[], None] | None = None


#: What launchers that start members on demand reserve: no writes, always room (the
#: service's own `--max-workers` limits local and docker members).
NOTHING = Reservation()


class WorkerLauncher(Protocol):
    def reserve(self, launch: Launch) -> Reservation | None:
        """The room the attempt takes, or None when it does not fit now."""
        ...

    def start(self, launch: Launch, index: int) -> Member:
        """Start `launch.command` as that member (or find it running)."""
        ...

    def exit_code(self, member: Member) -> int | None:
        """None while the member runs; its exit code once it ended (`VANISHED` if unknown)."""
        ...

    def terminate(self, member: Member) -> None:
        """Ask the member to leave (SIGTERM): it fails its phase cleanly, naming why."""
        ...

    def kill(self, member: Member) -> None: ...

    def output(self, member: Member, offset: int) -> bytes:
        """The member's output (stdout and stderr, interleaved) from byte `offset` on, at
        most `OUTPUT_CAP` bytes of it (read on with `output_cursor.OutputCursor`)."""
        ...

    def remove(self, run_id: str) -> int:
        """Forget a finished submission: its members' logs or containers; how many."""
        ...

    def never_fits(self, spec: JobSpec) -> str | None:
        """Why this launcher could never run the job at once (None: it could), asked at
        submission so that such a job is refused instead of queued for ever."""
        ...

    def placement_ended(self, run_id: str, attempt: int) -> None:
        """The attempt's members are gone: what let them start (a placement written
        ahead of its commit) goes too."""
        ...

    def sweep(self) -> int:
        """Remove what placements written ahead but never committed left (after a
        grace); how many."""
        ...

    def close(self) -> None:
        """Stop what the launcher runs of its own (a watch, a client's connections)."""
        ...


class OnDemandLauncher:
    """What a launcher that starts members on demand answers to the questions only
    placement asks (`WorkerLauncher`): any job may fit, nothing is placed ahead, and
    nothing of its own runs until closed."""

    def never_fits(self, spec: JobSpec) -> str | None:
        return None

    def placement_ended(self, run_id: str, attempt: int) -> None:
        return None

    def sweep(self) -> int:
        return 0

    def close(self) -> None:
        return None
