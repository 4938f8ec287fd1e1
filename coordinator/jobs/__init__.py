"""Job kinds: what a member does between `ip_exchange` and the `training` barrier.

A job is built from its parameters and the world size before the member joins
(bad input fails there, on every member, before anything is written to etcd),
then gets two calls: `on_roster` once the roster is known (before `connect`:
the place to start a service the others must reach, or to load data), and
`run` after `connect`. `close` always follows.

The `command` kind (any program as each member) is built by `make_job` from a
program as well, so it is not in `JOB_KINDS`: the service's API takes it as a
spec with a `command` (and an exec token), not as parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Protocol

from coordinator.jobs import noop, steps
from coordinator.rendezvous.member import Member


class Job(Protocol):
    def on_roster(self, member: Member) -> None: ...

    def run(self, member: Member) -> dict[str, object]:
        """Train; returns a small JSON-able summary."""
        ...

    def close(self) -> None: ...


#: (parameters, world size) -> a job; raises ValueError naming a bad parameter.
JobFactory = Callable[[dict[str, str], int], Job]


@dataclass
class FunctionJob:
    """A job that is one function of the member (its checked options bound in)."""

    function: Callable[[Member], dict[str, object]]

    def on_roster(self, member: Member) -> None:
        pass

    def run(self, member: Member) -> dict[str, object]:
        return self.function(member)

    def close(self) -> None:
        pass


def _noop(params: dict[str, str], world_size: int) -> Job:
    return FunctionJob(partial(noop.run, seconds=noop.check(params)))


def _steps(params: dict[str, str], world_size: int) -> Job:
    return FunctionJob(partial(steps.run, options=steps.parse(params, world_size)))


def _xgboost(params: dict[str, str], world_size: int) -> Job:
    from coordinator.jobs.boosting import XGBoostJob  # XGBoost takes a second to import

    return XGBoostJob(params, world_size)


def mnist_module() -> ModuleType:
    """`coordinator.jobs.mnist` (PyTorch: an extra, and slow to import), or a ValueError
    that says how to install it."""
    try:
        from coordinator.jobs import mnist
    except ImportError as exc:
        raise ValueError(
            f"mnist job: needs PyTorch ({exc.name} is missing): "
            "pip install 'etcd-coordinator[mnist]'"
        ) from None
    return mnist


def _mnist(params: dict[str, str], world_size: int) -> Job:
    return mnist_module().MnistJob(params, world_size)


JOB_KINDS: dict[str, JobFactory] = {
    "noop": _noop,
    "steps": _steps,
    "xgboost": _xgboost,
    "mnist": _mnist,
}

COMMAND = "command"

#: The kinds `coordinator worker` and `coordinator run` take.
MEMBER_KINDS = [*JOB_KINDS, COMMAND]


def make_job(
    kind: str, params: dict[str, str], world_size: int, program: Sequence[str] | None = None
) -> Job:
    """A member's job of `kind`; `program` (a list, never split or joined) only for
    `command`. Raises ValueError naming bad input."""
    if kind == COMMAND:
        from coordinator.jobs.command import CommandJob

        return CommandJob(params, world_size, program or [])
    if program is not None:
        raise ValueError(f"a program after -- runs only with kind {COMMAND}, not {kind}")
    return JOB_KINDS[kind](params, world_size)
