"""What the REST service stores and returns: job specs, states, conditions, attempts.

One job record (`JobRecord`) per job, as JSON at `<ns>/api/jobs/<id>`; it is
the only state the service has, so any replica can answer for any job and a
restart loses nothing.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from coordinator.keys import member_name
from coordinator.service.json_values import text_problem

ID_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"  # a DNS label: also a container name
MAX_ARGS = 256  # a command's program and arguments
MAX_ARG_CHARS = 4096
LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,62})$")


def _program_env(value: dict[str, str]) -> dict[str, str]:
    from coordinator.jobs.environment import check_program_env  # not at import: it is slow

    return check_program_env(value)


#: The check of a `command` job's variables for its program, as submitted and as an agent
#: reads them: valid names, bounded, none the member sets itself (`check_program_env`).
#: Last in a field's `Annotated`, after its constraints, as a field validator would run.
CHECK_PROGRAM_ENV = AfterValidator(_program_env)


class JobState(StrEnum):
    PENDING = "PENDING"  # queued: waiting for worker slots
    STARTING = "STARTING"  # an attempt's members are being started
    RUNNING = "RUNNING"  # every member of the attempt passed `connect`
    RESTARTING = "RESTARTING"  # an attempt failed and `max_restarts` allows another
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class Launcher(StrEnum):
    LOCAL = "local"  # worker processes on the service's machine
    DOCKER = "docker"  # containers through the docker SDK (podman's socket works)
    AGENTS = "agents"  # processes run by `coordinator agent`s on any number of hosts
    KUBERNETES = "kubernetes"  # an Indexed Job's pods


class JobSpec(BaseModel):
    """What a user submits. Two submits of the same id must carry an equal spec."""

    model_config = ConfigDict(extra="forbid")

    id: Annotated[str, Field(pattern=ID_PATTERN, description="[generated when absent]")] = ""
    kind: Annotated[str, Field(description="one of GET /v1/kinds")]
    workers: Annotated[int, Field(ge=1, le=1024)]
    params: dict[str, str] = Field(default_factory=dict)
    launcher: Annotated[Launcher, Field(description="[the service's default]")] = Launcher.LOCAL
    max_restarts: Annotated[int, Field(ge=0, le=100)] = 0
    deadline_seconds: Annotated[float | None, Field(gt=0, le=30 * 86400)] = None
    priority: Annotated[int, Field(ge=-1000, le=1000)] = 0
    labels: dict[str, str] = Field(default_factory=dict)
    agent_selector: Annotated[
        dict[str, str],
        Field(description="agents launcher: labels an agent must carry to run a member"),
    ] = Field(default_factory=dict)
    gpus_per_worker: Annotated[
        int,
        Field(
            ge=0,
            le=64,
            description="whole GPUs each member gets (agents: of their --gpus, as "
            "CUDA_VISIBLE_DEVICES; kubernetes: nvidia.com/gpu)",
        ),
    ] = 0
    # The `command` kind only (an exec token): the program each member runs, as a list
    # (never split or joined), its extra variables, and its folder (under the service's
    # --working-dir-root).
    command: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_ARG_CHARS)]] | None,
        Field(min_length=1, max_length=MAX_ARGS, description="command: PROGRAM ARGS..."),
    ] = None
    env: Annotated[
        dict[str, str],
        Field(max_length=128, description="command: the program's variables"),
        CHECK_PROGRAM_ENV,
    ] = Field(default_factory=dict)
    working_dir: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=1024,
            description="command: the folder the program runs in, under the working-dir "
            "root of the host that runs it (serve --working-dir-root, an agent's data dir or "
            "roots; relative: from the root); absent: the root itself. docker, kubernetes: "
            "the container's absolute working directory",
        ),
    ] = None
    image: Annotated[
        str | None,
        Field(
            min_length=1,
            max_length=255,
            description="command, docker launcher: the image its members run in "
            "[the service's --docker-image]; one the service allows",
        ),
    ] = None

    @field_validator("image")
    @classmethod
    def _image_reference(cls, value: str | None) -> str | None:
        from coordinator.service.images import check_reference

        return value if value is None else check_reference(value)

    @field_validator("params", mode="before")
    @classmethod
    def _params_as_text(cls, value: Any) -> Any:
        """Parameters reach workers as `--param k=v`: numbers and booleans become text."""
        if isinstance(value, dict):
            return {key: _as_text(item) for key, item in value.items()}
        return value

    @model_validator(mode="after")
    def _plain_text(self) -> JobSpec:
        """No NUL and no lone surrogate in any text of the spec (the API refuses them at
        its boundary; this holds for a record read from etcd too): no program, store or
        answer could take one."""
        for location, text in _texts(self):
            problem = text_problem(text)
            if problem:
                raise ValueError(f"{location}: {problem}")
        return self

    @field_validator("labels", "agent_selector")
    @classmethod
    def _label_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key, text in value.items():
            if not LABEL_KEY.match(key) or len(text) > 63:
                raise ValueError(f"label {key!r}: keys are 1-63 of [A-Za-z0-9._/-], values <= 63")
        return value


def _texts(spec: JobSpec) -> list[tuple[str, str]]:
    """(where, text) for every text of the spec, keys included."""
    found = [("id", spec.id), ("kind", spec.kind)]
    found += [(name, value) for name in ("working_dir", "image") if (value := getattr(spec, name))]
    found += [(f"command[{i}]", arg) for i, arg in enumerate(spec.command or [])]
    for name in ("params", "labels", "agent_selector", "env"):
        for key, value in getattr(spec, name).items():
            found += [(name, key), (f"{name}.{key!r}", value)]
    return found


def _as_text(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return value  # text, or something pydantic then refuses


#: What a record read from etcd must be before the service acts on it: strict types (no
#: "3" for 3), no field this version does not know, no NaN or infinity. Stored records
#: are validated with `strict=True`, which holds for the nested spec too.
RECORD_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
UID_PATTERN = r"^[0-9a-f]{32}$"  # uuid4().hex: part of the names of files and containers
#: `JobRecord.run_id`: the id, then the uid's first 8 hex digits.
RUN_ID_PATTERN = ID_PATTERN.removesuffix("$") + "-[0-9a-f]{8}$"
PID_MAX = 4_194_304  # the largest pid Linux can hand out
_DNS_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
#: docker: the container's id; kubernetes: `<namespace>/<job name>/<index>`.
CONTAINER_PATTERN = rf"^([0-9a-f]{{64}}|{_DNS_LABEL}/{_DNS_LABEL}/[0-9]{{1,4}})$"
#: agents: `<agent id>/<run_id>-a<attempt>-m<index>`.
ASSIGNMENT_PATTERN = (
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}/"
    + RUN_ID_PATTERN.removeprefix("^").removesuffix("$")
    + r"-a[0-9]{1,3}-m[0-9]{1,4}$"
)
Time = Annotated[float, Field(ge=0)]  # Unix time
ExitCode = Annotated[int, Field(ge=-1, le=255)]  # -1: `launchers.VANISHED`


class Condition(BaseModel):
    """One state the job entered: when and why (the job's history)."""

    model_config = RECORD_CONFIG

    state: JobState
    reason: str
    at: Time


class Member(BaseModel):
    """One member of an attempt, as the launcher and the member's own output tell.

    How it is found again (`pid` and `started`, `container` or `assignment`) is
    checked against the record's launcher, run id, attempt and index, so a record
    can only name its own members."""

    model_config = RECORD_CONFIG

    index: Annotated[int, Field(ge=0)]  # the launcher's numbering (0..workers-1)
    pid: Annotated[int, Field(gt=0, le=PID_MAX)] | None = None
    container: Annotated[str, Field(pattern=CONTAINER_PATTERN)] | None = None
    assignment: Annotated[str, Field(pattern=ASSIGNMENT_PATTERN)] | None = None
    started: Annotated[float, Field(gt=0)] | None = None  # the pid's start time (None: unknown)
    # A local member's output, relative to the launcher's logs folder. Always derived from
    # the record's run id, attempt and index when a record is validated, whatever was
    # stored; the launcher checks it again before it opens anything.
    log: str | None = None
    rank: Annotated[int, Field(ge=0)] | None = None  # the rendezvous' (< workers)
    role: Annotated[str, Field(max_length=100)] | None = None  # what its rank does (the kind's)
    address: Annotated[str, Field(max_length=300)] | None = None
    phase: Annotated[str, Field(max_length=200)] = "starting"
    exit_code: ExitCode | None = None
    failure: dict[str, Any] | None = None  # the member's `failed` event


class Attempt(BaseModel):
    model_config = RECORD_CONFIG

    number: Annotated[int, Field(ge=1)]  # 1, 2, ... (its place in `attempts`)
    started_at: Time
    ended_at: Time | None = None
    members: list[Member] = Field(default_factory=list)
    outcome: str | None = None  # why the attempt ended (or is being ended)
    # Once the attempt is being stopped: when the members got SIGTERM, and the state the
    # job enters once they are all gone.
    stopping_since: Time | None = None
    then: JobState | None = None


class Progress(BaseModel):
    model_config = RECORD_CONFIG

    step: int | None = None  # rounds (xgboost) or steps (steps, mnist) done
    total: int | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    updated_at: Time | None = None


class JobRecord(BaseModel):
    model_config = RECORD_CONFIG

    id: Annotated[str, Field(pattern=ID_PATTERN)]
    # Unique per submission: an id used again after a delete is another job.
    uid: Annotated[str, Field(pattern=UID_PATTERN)]
    spec: JobSpec
    state: JobState
    conditions: list[Condition]
    attempts: list[Attempt] = Field(default_factory=list)
    progress: Progress = Field(default_factory=Progress)
    artifacts: dict[str, str] = Field(default_factory=dict)
    submitted_at: Time
    cancel_requested_at: Time | None = None
    # The service's Ed25519 signature over every other field (`coordinator.signing`): a
    # record it did not write is never acted on.
    signature: Annotated[str, Field(max_length=100)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> JobRecord:
        """What no field alone can say: the spec is this job's, attempts are numbered
        1, 2, ... within `max_restarts`, and each member is one of the attempt's own."""
        if self.spec.id != self.id:
            raise ValueError(f"spec.id {self.spec.id!r} is not the record's id {self.id!r}")
        if len(self.attempts) > self.spec.max_restarts + 1:
            raise ValueError(
                f"{len(self.attempts)} attempts, but max_restarts {self.spec.max_restarts} "
                f"allows {self.spec.max_restarts + 1}"
            )
        for position, attempt in enumerate(self.attempts, 1):
            if attempt.number != position:
                raise ValueError(f"attempt {position} says it is number {attempt.number}")
            seen: set[int] = set()
            for member in attempt.members:
                problem = _member_problem(self, attempt.number, member, seen)
                if problem:
                    raise ValueError(f"attempt {attempt.number}, member {member.index}: {problem}")
                seen.add(member.index)
                member.log = self.log_path(attempt.number, member.index)
        return self

    @property
    def attempt(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def run_id(self) -> str:
        """What launchers name this submission's members and logs by."""
        return f"{self.id}-{self.uid[:8]}"

    def log_path(self, attempt: int, index: int) -> str | None:
        """Where a local member's output goes, relative to the launcher's logs folder."""
        if self.spec.launcher != Launcher.LOCAL:
            return None
        return f"{self.run_id}/attempt-{attempt}/member-{index}.log"


def _member_problem(record: JobRecord, attempt: int, member: Member, seen: set[int]) -> str:
    """Why `member` cannot be one of the attempt's members ("" when it can)."""
    workers = record.spec.workers
    if member.index >= workers:
        return f"index {member.index} is out of range for {workers} workers"
    if member.index in seen:
        return "index recorded twice"
    if member.rank is not None and member.rank >= workers:
        return f"rank {member.rank} is out of range for {workers} workers"
    launcher = record.spec.launcher
    if launcher == Launcher.LOCAL:
        if member.container or member.assignment:  # no pid: never signalled, reads as ended
            return "a local member is found by its pid only"
    elif member.pid is not None:
        return f"a {launcher} member has no pid of the service's"
    if launcher == Launcher.DOCKER and not re.fullmatch("[0-9a-f]{64}", member.container or ""):
        return "a docker member is found by its container id"
    if launcher == Launcher.KUBERNETES and (
        member.container is None or not member.container.endswith(f"/{member.index}")
    ):
        return "a kubernetes member is found by <namespace>/<job>/<its index>"
    if launcher == Launcher.AGENTS and (
        member.assignment is None
        or not member.assignment.endswith("/" + member_name(record.run_id, attempt, member.index))
    ):
        return "an agents member is found by <agent>/<run id>-a<attempt>-m<its index>"
    return ""


class JobList(BaseModel):
    jobs: list[JobRecord]
    next_page_token: str | None = None


# -- the simulator's request and answer (`POST /v1/simulate`) ---------------------------


class SimulationRequest(BaseModel):
    """A simulator run: its size is priced before it starts (see `simulation`)."""

    barrier: Annotated[str, Field(max_length=200, description="methods, e.g. bsp,ssp:2,asp")] = (
        "bsp,ssp:2,asp"
    )
    workers: Annotated[int, Field(ge=1, le=10_000)] = 100
    seconds: Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)] = 100.0
    delay: Annotated[
        str,
        Field(
            max_length=200,
            description="exp:SHIFT,MEAN | gamma:SHAPE,SCALE | straggler:FRACTION,FACTOR[,BASE]"
            " (no trace: that reads a server file; `coordinator simulate` takes it)",
        ),
    ] = "exp:1,1"
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 0


class SimulatedMethod(BaseModel):
    label: str
    summary: dict[str, float | int | str]
    final_steps: list[int]  # sorted: the CDF's x values


class Simulation(BaseModel):
    methods: list[SimulatedMethod]
