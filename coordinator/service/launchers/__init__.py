"""How the service starts, watches and stops a job's members: one launcher per kind.

Starting an attempt takes two steps. `reserve` first says whether the attempt
fits now, and returns the etcd writes that take its room (the agents launcher
writes every member's assignment). The reconciler commits them in the same
transaction that moves the job to STARTING, so a job is placed whole or not at
all, and two replicas never both take the same room. Then `start` starts each
member not yet recorded.

A launcher starts member `index` of attempt `attempt` of a job, idempotently:
asked again for the same member (a new leader finishing its predecessor's
launch), it returns the member already running instead of a second one. What
it returns is recorded in the job's record in etcd (a pid and its start time,
or a container id), so any replica can later find, follow and stop the member,
including one started by a service process that has since died.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from coordinator.etcd.client import Guard, Put
from coordinator.etcd.security import ENV
from coordinator.etcd.users import Credentials
from coordinator.jobs.environment import PROGRAM_DIR, PROGRAM_ENV
from coordinator.service.model import JobSpec, Launcher, Member


class LauncherUnavailable(Exception):
    """A launcher asked for cannot work here (no configuration, a bad option)."""


#: The launchers whose members count against the service's own `--max-workers` (they
#: run on its machine, or its container engine); agents and Kubernetes have their own.
OWN_SLOTS = frozenset({Launcher.LOCAL, Launcher.DOCKER})

#: The exit code recorded for a member that ended without a word: killed by a
#: signal while not our child, so neither a status nor a last event tells how.
VANISHED = -1


def split_program(worker_args: list[str]) -> tuple[list[str], list[str] | None]:
    """(the worker's options, the program after `--` or None). The options are pairs, so
    only a `--` where an option name stands starts the program (never a value)."""
    for i in range(0, len(worker_args), 2):
        if worker_args[i] == "--":
            return list(worker_args[:i]), list(worker_args[i + 1 :])
    return list(worker_args), None


def with_etcd(worker_args: list[str], endpoints: str) -> list[str]:
    """`worker_args` with every `--etcd` value replaced by `endpoints` (the program's own
    arguments after `--` stay as they are)."""
    args, program = split_program(worker_args)
    for i, arg in enumerate(args):
        if arg == "--etcd" and i + 1 < len(args):
            args[i + 1] = endpoints
        elif arg.startswith("--etcd="):
            args[i] = f"--etcd={endpoints}"
    return args if program is None else [*args, "--", *program]


def program_settings(spec: JobSpec) -> dict[str, str]:
    """A `command` member's environment entries for its program's variables and folder
    (never argv: values may be secrets); the member takes them out and checks them."""
    settings = {}
    if spec.env:
        settings[PROGRAM_ENV] = json.dumps(spec.env)
    if spec.working_dir:
        settings[PROGRAM_DIR] = spec.working_dir
    return settings


@dataclass(frozen=True)
class Launch:
    """One attempt of a job, as its members are started."""

    run_id: str  # names the submission's members, logs and containers
    attempt: int  # 1, 2, ...
    spec: JobSpec
    worker_args: list[str]  # `coordinator worker <worker_args>`, the same for every member
    # The job's own etcd user (never in `worker_args`: argv is public). None: the members
    # connect as their launcher does (etcd without auth, or a service that may not make
    # users).
    credentials: Credentials | None = None


def member_environment(launch: Launch, password_file: Path | str) -> dict[str, str]:
    """The variables that make a member connect as its job's etcd user, replacing the
    launcher's own: the user and the file its launcher wrote the password to (empty
    without credentials: the member inherits its launcher's settings)."""
    if launch.credentials is None:
        return {}
    return {
        ENV["user"]: launch.credentials.user,
        ENV["password_file"]: str(Path(password_file).absolute()),
    }


@dataclass(frozen=True)
class Reservation:
    """The room an attempt takes, written atomically with the job's move to STARTING."""

    puts: list[Put] = field(default_factory=list)
    # What must still hold: the agents placed on are the ones read, and nobody else
    # placed members on them since.
    guards: list[Guard] = field(default_factory=list)
    members: list[Member] = field(default_factory=list)  # recorded at once (placed members)


#: What launchers that start members on demand reserve: no writes, always room (the
#: service's own `--max-workers` limits local and docker members).
NOTHING = Reservation()


class WorkerLauncher(Protocol):
    def reserve(self, launch: Launch) -> Reservation | None:
        """The room the attempt takes, or None when it does not fit now."""
        ...

    def start(self, launch: Launch, index: int) -> Member:
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
