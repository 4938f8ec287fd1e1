"""Job kinds as plugins: one `JobKind` holds all the product needs to know of a kind.

Its parameters (`catalog`), its checks at submit, how to build a member's job,
how a retry changes its parameters, its step barrier, its members' roles by
rank and the charts it has data for. The service serves `describe()` as
`GET /v1/kinds`, so the dashboard names no kind; the reconciler asks the kind
what a retry runs with. Importing this module imports neither PyTorch nor
XGBoost: a kind imports those only when it builds or checks a job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict

from coordinator.datasets.source import shape_only
from coordinator.jobs import catalog, noop, steps
from coordinator.jobs.catalog import Param
from coordinator.rendezvous.member import Member

Chart = Literal["curve", "clocks"]  # a learning curve; step clocks and staleness
COMMAND = "command"
MNIST_BUILTIN = "digits"


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


class RoleSpan(BaseModel):
    """Consecutive ranks with one role: `count_param` of them (its value, else
    `count_default`), or, without a count, every rank left."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: str
    count_param: str | None = None
    count_default: int = 1


class Barrier(BaseModel):
    """The kind's steps are paced by the step barrier (its `method` parameter)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    default_method: str | None  # None: the submitter must choose


class SpecField(BaseModel):
    """A field of the job's spec (beside `params`) that the kind takes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    type: Literal["list", "map", "text"]  # a JSON list of text, a JSON object of text, text
    description: str


PROGRAM_FIELDS = (
    SpecField(name="command", type="list", description="the program and its arguments"),
    SpecField(name="env", type="map", description="the program's extra variables"),
    SpecField(name="working_dir", type="text", description="the program's folder"),
)


class KindInfo(BaseModel):
    """What `GET /v1/kinds` says of a kind: enough for a form and a job's page."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str
    params: list[Param]
    example: dict[str, str]  # parameters a first try could submit
    roles: list[RoleSpan]  # by rank, in order
    charts: list[Chart]
    barrier: Barrier | None
    needs_exec: bool  # only an exec token may submit it
    takes_command: bool  # takes `command`, `env` and `working_dir`
    spec_fields: list[SpecField]  # those fields, for a form


WORKERS = (RoleSpan(role="worker"),)


@dataclass(frozen=True)
class JobKind:
    """A kind of job. Subclasses override `build` (and `check`, `retry_params` where
    they differ); the rest is data."""

    name: str
    description: str
    params: tuple[Param, ...]
    example: dict[str, str] = field(default_factory=dict)
    roles: tuple[RoleSpan, ...] = WORKERS
    charts: tuple[Chart, ...] = ()
    barrier: Barrier | None = None
    needs_exec: bool = False
    takes_command: bool = False
    #: The keys of a member's result that name a file it wrote (the job's artifacts).
    artifacts: tuple[str, ...] = ()

    def build(self, params: dict[str, str], world_size: int) -> Job:
        """A member's job; raises ValueError naming a bad parameter."""
        raise NotImplementedError

    def build_member(
        self, params: dict[str, str], world_size: int, program: Sequence[str] | None
    ) -> Job:
        if program is not None:
            raise ValueError(f"a program after -- runs only with kind {COMMAND}, not {self.name}")
        return self.build(params, world_size)

    def check(self, params: dict[str, str], workers: int) -> None:
        """The checks at submit, reading no file: a ValueError names the parameter."""
        with shape_only():
            self.build(params, workers).close()

    def retry_params(self, params: dict[str, str], attempt: int) -> dict[str, str]:
        """The parameters attempt `attempt` (1, 2, ...) runs with."""
        return dict(params)

    def barrier_params(self, params: dict[str, str]) -> dict[str, str] | None:
        """The parameters with the barrier's default method filled in (None: no barrier)."""
        if self.barrier is None:
            return None
        default = {"method": self.barrier.default_method} if self.barrier.default_method else {}
        return {**default, **params}

    def role(self, params: dict[str, str], rank: int) -> str:
        """What `rank` does, from `roles` (a count that is not a number counts its
        default), and whether it is the slowed one (`straggler_rank`): the dashboard's."""
        said = [self._span_role(params, rank)]
        if params.get("straggler_rank", "").strip() == str(rank):
            factor = params.get("straggler_factor") or self._default("straggler_factor")
            said.append(f"straggler {factor or '?'}x")
        return ", ".join(part for part in said if part)

    def _span_role(self, params: dict[str, str], rank: int) -> str:
        start = 0
        for span in self.roles:
            if span.count_param is None:
                return span.role
            try:
                count = int(params.get(span.count_param, span.count_default))
            except ValueError:
                count = span.count_default
            if rank < start + count:
                return span.role
            start += count
        return ""

    def _default(self, name: str) -> str | None:
        return next((p.default for p in self.params if p.name == name), None)

    def describe(self) -> KindInfo:
        return KindInfo(
            name=self.name,
            description=self.description,
            params=list(self.params),
            example=self.example,
            roles=list(self.roles),
            charts=list(self.charts),
            barrier=self.barrier,
            needs_exec=self.needs_exec,
            takes_command=self.takes_command,
            spec_fields=list(PROGRAM_FIELDS) if self.takes_command else [],
        )


class NoopKind(JobKind):
    def build(self, params: dict[str, str], world_size: int) -> Job:
        return FunctionJob(partial(noop.run, seconds=noop.check(params)))


class StepsKind(JobKind):
    def build(self, params: dict[str, str], world_size: int) -> Job:
        return FunctionJob(partial(steps.run, options=steps.parse(params, world_size)))


class XGBoostKind(JobKind):
    def build(self, params: dict[str, str], world_size: int) -> Job:
        from coordinator.jobs.boosting import XGBoostJob  # XGBoost takes a second to import

        return XGBoostJob(params, world_size)

    def check(self, params: dict[str, str], workers: int) -> None:
        from coordinator.datasets import check_shards
        from coordinator.jobs.boosting import parse

        with shape_only():
            options = parse(params)
            for source in (options.data, options.eval_data):
                if source is not None and source.kind in ("synthetic", "builtin"):
                    check_shards(source, workers)  # no file: rows per member, counted


class MnistKind(JobKind):
    def build(self, params: dict[str, str], world_size: int) -> Job:
        return mnist_module().MnistJob(params, world_size)

    def check(self, params: dict[str, str], workers: int) -> None:
        # A folder's files are the members' to read: its shape is the admission's to check.
        shaped = {**params, "data": MNIST_BUILTIN} if "data" in params else params
        with shape_only():
            mnist_module().parse(shaped, workers)

    def retry_params(self, params: dict[str, str], attempt: int) -> dict[str, str]:
        """A new attempt continues from the servers' checkpoints (unless told otherwise)."""
        if attempt > 1:
            return {"resume": "true", **params}
        return dict(params)


class CommandKind(JobKind):
    def build(self, params: dict[str, str], world_size: int) -> Job:
        return self.build_member(params, world_size, [])

    def build_member(
        self, params: dict[str, str], world_size: int, program: Sequence[str] | None
    ) -> Job:
        from coordinator.jobs.command import CommandJob

        return CommandJob(params, world_size, program or [])

    def check(self, params: dict[str, str], workers: int) -> None:
        from coordinator.jobs.params import check_known, float_param

        check_known(COMMAND, params, catalog.names(self.params))  # the program: the member's
        grace_max = catalog.maximum(self.params, "grace_seconds")
        float_param(COMMAND, params, "grace_seconds", catalog.COMMAND_GRACE, grace_max)


KINDS: dict[str, JobKind] = {
    kind.name: kind
    for kind in (
        NoopKind(
            "noop",
            "rendezvous through every phase and train nothing: proves the plumbing",
            catalog.NOOP,
            example={"seconds": "10"},
        ),
        StepsKind(
            "steps",
            "timed steps paced by a step barrier on etcd: try out the barrier methods",
            catalog.STEPS,
            example={"method": "ssp", "staleness": "2", "num_steps": "100", "step_seconds": "0.05"},
            charts=("clocks",),
            barrier=Barrier(default_method=None),
        ),
        XGBoostKind(
            "xgboost",
            "distributed XGBoost (hist) over the members' shards of the data",
            (*catalog.XGBOOST, *catalog.XGBOOST_BOOSTER),
            example={"rounds": "30"},
            charts=("curve",),
            artifacts=("model_path",),
        ),
        MnistKind(
            "mnist",
            "a digit classifier trained on parameter servers, paced by a step barrier",
            catalog.MNIST,
            example={"epochs": "2", "method": "ssp", "staleness": "2"},
            roles=(RoleSpan(role="server", count_param="ps"), RoleSpan(role="trainer")),
            charts=("curve", "clocks"),
            barrier=Barrier(default_method="bsp"),
            artifacts=("model_path",),
        ),
        CommandKind(
            COMMAND,
            "any program as each member, with a torchrun-compatible environment",
            catalog.COMMAND,
            needs_exec=True,
            takes_command=True,
        ),
    )
}


def kind_of(name: str) -> JobKind:
    """The kind called `name`, or a ValueError that lists the known ones."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown job kind {name!r} (known: {', '.join(KINDS)})") from None


def make_job(
    kind: str, params: dict[str, str], world_size: int, program: Sequence[str] | None = None
) -> Job:
    """A member's job of `kind`; `program` (a list, never split or joined) only for
    `command`. Raises ValueError naming bad input, and a thread count above this host's
    cap (the member's own check: a record may reach etcd by other paths than a submit)."""
    from coordinator.jobs.threads import check_thread_caps, thread_cap

    chosen = kind_of(kind)
    check_thread_caps(kind, chosen.params, params, thread_cap())
    return chosen.build_member(params, world_size, program)
