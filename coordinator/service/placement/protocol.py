"""What agents and the service's `agents` launcher write to each other under `<ns>/`,
and the models every value read back must pass: neither side trusts what it reads
(the keys are composed and parsed in `coordinator.keys`).

- `agents/<id>`: `AgentRecord` (`{slots, labels, address, token, version, pid, host,
  gpus}`),
  bound to the agent's lease; created only if absent, so two live agents never
  share an id. `token` is the bearer token its output server asks for.
- `assignments/<id>/<member>`: an `Assignment`, a member the service placed on that
  agent (`{run_id, attempt, index, worker_args, credentials}`, with `command`, `env`
  and `working_dir` for a command job, `gpus` for one asking GPUs, `placement` for a
  placement written ahead of its commit, and `stop` once the service wants it
  stopped), bound to the agent's lease. Signed by the service (`signature`, over the
  agent's id and every other field, which include `registration`: the create
  revision of the registration it was placed on, so it never runs on another
  agent or a later registration of the same id). The agent deletes it when
  the member ends, so the assignments under an agent are its slots in use.
- `reports/<id>/<member>`: a `Report`, the member as its agent saw it last
  (`running`, then `exited`, or `refused` for an assignment it would not run),
  bound to the agent's lease. Written together with the assignment's deletion,
  so one of the two always exists while the agent lives.
- `placements/<placement>`: the commit of a placement too big for one transaction,
  written with the job's move to STARTING. Such a placement's assignments are
  written ahead, each naming it (`placement`); an agent starts one only once this
  key exists. `<placement>` is `<run_id>-a<attempt>-<16 hex digits>`, new for each
  try to place an attempt.

Each agent's etcd user may touch only its own three, and read the commits
(`coordinator.etcd.users`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from coordinator.etcd.users import Credentials, job_user
from coordinator.jobs import COMMAND
from coordinator.jobs.kinds import kind_of
from coordinator.keys import PLACEMENT_TOKEN, placements_of
from coordinator.launch import WorkerCommand
from coordinator.launch.command import check_gpus
from coordinator.service.model import CHECK_PROGRAM_ENV, ID_PATTERN, MAX_ARG_CHARS, MAX_ARGS
from coordinator.signing import (
    ASSIGNMENT,
    SIGNATURE,
    SignatureError,
    Signer,
    canonical,
    loads_object,
    split,
    verify,
)

REGISTRATION = "registration"  # an assignment's field: the registration it was placed on

RUN_ID_PATTERN = ID_PATTERN.removesuffix("$") + r"-[A-Za-z0-9]{1,32}$"
PLACEMENT_PATTERN = RUN_ID_PATTERN.removesuffix("$") + r"-a[0-9]{1,4}-" + PLACEMENT_TOKEN + "$"
ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]{1,253}):(?P<port>\d{1,5})$")

#: The options the service writes into `worker_args`, and whether one may repeat.
WORKER_OPTIONS = {
    "--job": False,
    "--world-size": False,
    "--etcd": False,
    "--namespace": False,
    "--kind": False,
    "--ttl": False,
    "--connect-timeout": False,
    "--param": True,
}


class AgentRecord(BaseModel):
    """An agent's registration, as the service may use it."""

    slots: Annotated[int, Field(ge=1, le=10_000)]
    labels: dict[Annotated[str, Field(max_length=63)], Annotated[str, Field(max_length=253)]] = {}
    address: Annotated[str, Field(max_length=300)]
    token: Annotated[str, Field(min_length=32, max_length=256)]
    version: str = ""
    pid: int = 0
    host: str = ""
    gpus: tuple[int, ...] = ()  # the GPU ids it offers (`agent --gpus`)

    @field_validator("gpus")
    @classmethod
    def _gpu_ids(cls, gpus: tuple[int, ...]) -> tuple[int, ...]:
        return check_gpus(gpus)

    @field_validator("address")
    @classmethod
    def _host_and_port(cls, address: str) -> str:
        match = ADDRESS.match(address)
        if match is None or not 0 < int(match["port"]) < 65536:
            raise ValueError(f"{address!r} is not HOST:PORT")
        return address


class AssignedCredentials(BaseModel):
    """The job's etcd user, for the member only (the assignment is the agent's to read)."""

    model_config = ConfigDict(extra="forbid")
    user: Annotated[str, Field(min_length=1, max_length=512)]
    password: Annotated[str, Field(min_length=16, max_length=512, repr=False)]

    def credentials(self) -> Credentials:
        return Credentials(self.user, self.password)


class Assignment(BaseModel):
    """A member placed on an agent. Validated with the agent's context
    (`{"namespace": ..., "data_dir": Path}`), so nothing in it reaches beyond the
    options the service writes, the agent's namespace or its data dir."""

    model_config = ConfigDict(extra="forbid")
    run_id: Annotated[str, Field(pattern=RUN_ID_PATTERN)]
    attempt: Annotated[int, Field(ge=1, le=1000)]
    index: Annotated[int, Field(ge=0, le=1023)]
    worker_args: Annotated[list[Annotated[str, Field(max_length=4096)]], Field(max_length=512)]
    credentials: AssignedCredentials | None = None
    stop: Literal["SIGTERM", "SIGKILL"] | None = None
    # The command kind only: the program (run after `--`), its variables and its folder.
    command: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_ARG_CHARS)]] | None,
        Field(min_length=1, max_length=MAX_ARGS),
    ] = None
    env: Annotated[dict[str, str], CHECK_PROGRAM_ENV] = Field(default_factory=dict)
    working_dir: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    gpus: tuple[int, ...] = ()  # the member's GPU ids on its agent
    # The placement it belongs to, when it was written ahead of its commit: it runs only
    # once `placements/<placement>` exists.
    placement: Annotated[str, Field(pattern=PLACEMENT_PATTERN)] | None = None

    @field_validator("gpus")
    @classmethod
    def _gpu_ids(cls, gpus: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        """Valid ids, and only ones the agent declared (when it says which)."""
        check_gpus(gpus)
        declared = (info.context or {}).get("gpus")
        if declared is not None and not set(gpus) <= set(declared):
            raise ValueError(f"GPUs {sorted(set(gpus) - set(declared))} are not this agent's")
        return gpus

    @field_validator("working_dir")
    @classmethod
    def _working_dir_inside(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Inside the agent's data dir or one of its configured working-dir roots."""
        roots = (info.context or {}).get("working_dir_roots")
        if value is None or roots is None:
            return value
        if not os.path.isabs(value):
            raise ValueError(f"working_dir {value!r} is not an absolute path")
        resolved = Path(os.path.realpath(value))
        if not any(resolved.is_relative_to(os.path.realpath(root)) for root in roots):
            raise ValueError(f"working_dir {value!r} is outside the agent's roots")
        return value

    @field_validator("worker_args")
    @classmethod
    def _only_the_service_options(cls, args: list[str], info: ValidationInfo) -> list[str]:
        pairs = _pairs(args)
        for name, _ in pairs:
            if name not in WORKER_OPTIONS:
                raise ValueError(f"{name!r} is not an option the service gives members")
        command = _parsed(args)
        if not re.match(ID_PATTERN, command.job_id):
            raise ValueError(f"--job {command.job_id!r} is not a job id")
        if not 1 <= command.world_size <= 1024:
            raise ValueError("--world-size must be a whole number of 1..1024")
        if command.ttl is not None and not 2 <= command.ttl <= 3600:
            raise ValueError("--ttl must be a whole number of seconds, 2..3600")
        if command.connect_timeout is not None and not 1 <= command.connect_timeout <= 3600:
            raise ValueError("--connect-timeout must be 1..3600 seconds")
        context = info.context or {}
        namespace = context.get("namespace")
        if namespace is not None and _namespace(command) != namespace:
            raise ValueError(f"--namespace {_namespace(command)!r} is not this agent's")
        data_dir = context.get("data_dir")
        if data_dir is not None:
            for key, param in command.params.items():
                _inside(f"--param {key}", param, data_dir)
        return args

    def worker_command(self, etcd: str) -> WorkerCommand:
        """What the agent runs: the assigned command reaching etcd at `etcd` (the agent's
        endpoints), with the program, its variables, folder and GPUs (the credentials are
        the launcher's to write to a file)."""
        return _parsed(self.worker_args).model_copy(
            update={
                "etcd": etcd,
                "program": tuple(self.command) if self.command is not None else None,
                "program_env": self.env,
                "working_dir": self.working_dir,
                "gpus": tuple(self.gpus),
            }
        )

    @model_validator(mode="after")
    def _consistent(self) -> Assignment:
        command = _parsed(self.worker_args)
        job = command.job_id
        if not self.run_id.startswith(job + "-"):
            raise ValueError(f"run_id {self.run_id!r} is not of job {job!r}")
        if self.placement is not None and not placements_of(self.run_id, self.attempt).fullmatch(
            self.placement
        ):
            raise ValueError(f"placement {self.placement!r} is not of this run and attempt")
        if self.index >= command.world_size:
            raise ValueError(f"index {self.index} is not below --world-size")
        is_command = command.kind is not None and kind_of(command.kind).takes_command
        if is_command != (self.command is not None):
            raise ValueError(f"a command is given with --kind {COMMAND} only, and it needs one")
        if not is_command and (self.env or self.working_dir):
            raise ValueError(f"env and working_dir are for --kind {COMMAND} only")
        if self.credentials is not None:
            expected = job_user(_namespace(command), job)
            if self.credentials.user != expected:
                raise ValueError(f"credentials are not job {job!r}'s etcd user")
        return self


def signed_assignment(signer: Signer, agent_id: str, assignment: dict[str, object]) -> bytes:
    """The assignment as stored for agent `agent_id`, signed by the service (it names
    the agent's `registration` revision)."""
    payload = {k: v for k, v in assignment.items() if k != SIGNATURE}
    signature = signer.sign(ASSIGNMENT, {"agent": agent_id, "assignment": payload})
    return canonical({**payload, SIGNATURE: signature})


def assignment_payload(key: Ed25519PublicKey, agent_id: str, raw: bytes) -> dict[str, object]:
    """The fields of the assignment `raw` but its signature, once that verifies as the
    service's for agent `agent_id`; `SignatureError` otherwise."""
    payload, signature = split(loads_object(raw))
    verify(key, ASSIGNMENT, {"agent": agent_id, "assignment": payload}, signature)
    return payload


def verified_assignment(
    key: Ed25519PublicKey, agent_id: str, registration: int, raw: bytes
) -> bytes:
    """The JSON of the assignment `raw` (no signature or registration) for `Assignment`
    to validate, once the service's signature verifies for this agent and this
    registration of it; `SignatureError` otherwise."""
    payload = assignment_payload(key, agent_id, raw)
    if payload.get(REGISTRATION) != registration:
        raise SignatureError(
            f"placed on registration {payload.get(REGISTRATION)!r} of agent {agent_id!r}, "
            f"not this one ({registration})"
        )
    return canonical({k: v for k, v in payload.items() if k != REGISTRATION})


class Report(BaseModel):
    """A member as its agent last saw it."""

    agent: str
    state: Literal["running", "exited", "refused"]
    pid: int | None = None
    exit_code: int | None = None
    at: float = 0.0
    reason: Annotated[str, Field(max_length=2000)] = ""


def _parsed(args: list[str]) -> WorkerCommand:
    """`worker_args` as the worker would take them (ValueError naming what is wrong)."""
    try:
        return WorkerCommand.from_argv(args)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ValueError(f"{where}: {error['msg']}") from None


def _namespace(command: WorkerCommand) -> str:
    """The namespace a member will use, as `Etcd` spells it (the worker's default too)."""
    given = (command.namespace if command.namespace is not None else "/coordinator").strip("/")
    return "/" + given if given else ""


def _pairs(args: list[str]) -> list[tuple[str, str]]:
    """`["--a", "1", "--b", "2"]` as pairs; anything else is refused."""
    if len(args) % 2:
        raise ValueError("worker_args must be option, value pairs")
    pairs = list(zip(args[::2], args[1::2], strict=True))
    for name, _ in pairs:
        if not name.startswith("--") or "=" in name:
            raise ValueError(f"{name!r} is not an option the service gives members")
    return pairs


def _inside(what: str, value: str, data_dir: Path) -> None:
    """A value that names a path must name one inside `data_dir` (relative ones are: a
    member runs there), so an assignment cannot make a member read or write elsewhere."""
    if not ("/" in value or value.startswith(("~", "."))):
        return  # a plain word: a number, a method, `builtin`, `synthetic:100x4`
    if value.startswith("~"):
        raise ValueError(f"{what}: {value!r} is outside the agent's data dir")
    root = data_dir.resolve()
    resolved = (root / value).resolve()  # an absolute value stays itself
    if resolved != root and root not in resolved.parents:
        raise ValueError(f"{what}: {value!r} is outside the agent's data dir")
