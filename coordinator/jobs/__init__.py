"""Job kinds: what a member does between `ip_exchange` and the `training` barrier.

A job is built from its parameters and the world size before the member joins
(bad input fails there, on every member, before anything is written to etcd),
then gets two calls: `on_roster` once the roster is known (before `connect`:
the place to start a service the others must reach, or to load data), and
`run` after `connect`. `close` always follows.

Each kind is a `JobKind` in `coordinator.jobs.kinds` (its parameters, checks,
roles, charts, and how a retry changes it). The `command` kind (any program as
each member) is built from a program as well, so it is not in `JOB_KINDS`: the
service's API takes it as a spec with a `command` (and an exec token), not as
parameters.
"""

from __future__ import annotations

from coordinator.jobs.kinds import (
    COMMAND,
    KINDS,
    FunctionJob,
    Job,
    JobFactory,
    JobKind,
    make_job,
    mnist_module,
)

#: The kinds that run from parameters alone (every kind but `command`).
JOB_KINDS: dict[str, JobKind] = {
    name: kind for name, kind in KINDS.items() if not kind.takes_command
}

#: The kinds `coordinator worker` and `coordinator run` take.
MEMBER_KINDS = list(KINDS)

__all__ = [
    "COMMAND",
    "JOB_KINDS",
    "KINDS",
    "MEMBER_KINDS",
    "FunctionJob",
    "Job",
    "JobFactory",
    "JobKind",
    "make_job",
    "mnist_module",
]
