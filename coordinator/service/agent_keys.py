"""The keys agents and the service's `agents` launcher share, under `<ns>/`, and the
models every value read from them must pass: neither side trusts what it reads.

- `agents/<id>`: `AgentRecord` (`{slots, labels, address, token, version, pid, host}`),
  bound to the agent's lease; created only if absent, so two live agents never
  share an id. `token` is the bearer token its output server asks for.
- `assignments/<id>/<member>`: an `Assignment`, a member the service placed on that
  agent (`{run_id, attempt, index, worker_args, credentials}`, with `command`, `env`
  and `working_dir` for a command job, and `stop` once the
  service wants it stopped), bound to the agent's lease. The agent deletes it when
  the member ends, so the assignments under an agent are its slots in use.
- `reports/<id>/<member>`: a `Report`, the member as its agent saw it last
  (`running`, then `exited`, or `refused` for an assignment it would not run),
  bound to the agent's lease. Written together with the assignment's deletion,
  so one of the two always exists while the agent lives.

Each agent's etcd user may touch only its own three (`coordinator.etcd.users`).
`<member>` is `<run_id>-a<attempt>-m<index>`: unique to one member of one attempt.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from coordinator.etcd.client import Etcd
from coordinator.etcd.users import Credentials, job_user
from coordinator.jobs import COMMAND, JOB_KINDS
from coordinator.jobs.environment import check_program_env
from coordinator.service.model import ID_PATTERN, MAX_ARG_CHARS, MAX_ARGS

RUN_ID_PATTERN = ID_PATTERN.removesuffix("$") + r"-[A-Za-z0-9]{1,32}$"
ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]{1,253}):(?P<port>\d{1,5})$")

#: The options the service writes into `worker_args`, and whether one may repeat.
WORKER_OPTIONS = {
    "--job": False,
    "--world-size": False,
    "--etcd": False,
    "--namespace": False,
    "--kind": False,
    "--ttl": False,
    "--param": True,
}


def member_name(run_id: str, attempt: int, index: int) -> str:
    return f"{run_id}-a{attempt}-m{index}"


def agent_key(etcd: Etcd, agent_id: str) -> str:
    return etcd.key("agents", agent_id)


def assignments_prefix(etcd: Etcd, agent_id: str | None = None) -> str:
    """Every agent's assignments, or one agent's."""
    return etcd.key("assignments", agent_id) + "/" if agent_id else etcd.key("assignments") + "/"


def assignment_key(etcd: Etcd, agent_id: str, member: str) -> str:
    return assignments_prefix(etcd, agent_id) + member


def reports_prefix(etcd: Etcd, agent_id: str | None = None) -> str:
    """Every agent's reports, or one agent's."""
    return etcd.key("reports", agent_id) + "/" if agent_id else etcd.key("reports") + "/"


def report_key(etcd: Etcd, agent_id: str, member: str) -> str:
    return reports_prefix(etcd, agent_id) + member


# -- what the values must be ---------------------------------------------------------------


class AgentRecord(BaseModel):
    """An agent's registration, as the service may use it."""

    slots: Annotated[int, Field(ge=1, le=10_000)]
    labels: dict[Annotated[str, Field(max_length=63)], Annotated[str, Field(max_length=253)]] = {}
    address: Annotated[str, Field(max_length=300)]
    token: Annotated[str, Field(min_length=32, max_length=256)]
    version: str = ""
    pid: int = 0
    host: str = ""

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
    env: dict[str, str] = Field(default_factory=dict)
    working_dir: Annotated[str, Field(min_length=1, max_length=1024)] | None = None

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return check_program_env(value)

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

    def option(self, name: str) -> str:
        """The value of a single option of `worker_args` (validated: it is there)."""
        return dict(_pairs(self.worker_args))[name]

    @field_validator("worker_args")
    @classmethod
    def _only_the_service_options(cls, args: list[str], info: ValidationInfo) -> list[str]:
        pairs = _pairs(args)
        seen = [name for name, _ in pairs]
        for name in seen:
            if name not in WORKER_OPTIONS:
                raise ValueError(f"{name!r} is not an option the service gives members")
            if not WORKER_OPTIONS[name] and seen.count(name) > 1:
                raise ValueError(f"{name} is given more than once")
        values = dict(pairs)
        for required in ("--job", "--world-size"):
            if required not in values:
                raise ValueError(f"{required} is missing")
        if not re.match(ID_PATTERN, values["--job"]):
            raise ValueError(f"--job {values['--job']!r} is not a job id")
        if not values["--world-size"].isdigit() or not 1 <= int(values["--world-size"]) <= 1024:
            raise ValueError("--world-size must be a whole number of 1..1024")
        if "--ttl" in values and not (
            values["--ttl"].isdigit() and 2 <= int(values["--ttl"]) <= 3600
        ):
            raise ValueError("--ttl must be a whole number of seconds, 2..3600")
        if values.get("--kind", "noop") not in (*JOB_KINDS, COMMAND):
            raise ValueError(f"--kind {values['--kind']!r} is not a job kind")
        context = info.context or {}
        namespace = context.get("namespace")
        if namespace is not None and _namespace(values) != namespace:
            raise ValueError(f"--namespace {_namespace(values)!r} is not this agent's")
        data_dir = context.get("data_dir")
        for name, value in pairs:
            if name == "--param":
                key, sep, param = value.partition("=")
                if not sep or not key:
                    raise ValueError(f"--param {value!r} is not KEY=VALUE")
                if data_dir is not None:
                    _inside(f"--param {key}", param, data_dir)
        return args

    @model_validator(mode="after")
    def _consistent(self) -> Assignment:
        job = self.option("--job")
        if not self.run_id.startswith(job + "-"):
            raise ValueError(f"run_id {self.run_id!r} is not of job {job!r}")
        if self.index >= int(self.option("--world-size")):
            raise ValueError(f"index {self.index} is not below --world-size")
        is_command = dict(_pairs(self.worker_args)).get("--kind") == COMMAND
        if is_command != (self.command is not None):
            raise ValueError(f"a command is given with --kind {COMMAND} only, and it needs one")
        if not is_command and (self.env or self.working_dir):
            raise ValueError(f"env and working_dir are for --kind {COMMAND} only")
        if self.credentials is not None:
            expected = job_user(_namespace(dict(_pairs(self.worker_args))), job)
            if self.credentials.user != expected:
                raise ValueError(f"credentials are not job {job!r}'s etcd user")
        return self


class Report(BaseModel):
    """A member as its agent last saw it."""

    agent: str
    state: Literal["running", "exited", "refused"]
    pid: int | None = None
    exit_code: int | None = None
    at: float = 0.0
    reason: Annotated[str, Field(max_length=2000)] = ""


def _namespace(options: dict[str, str]) -> str:
    """The namespace a member will use, as `Etcd` spells it (the worker's default too)."""
    given = options.get("--namespace", "/coordinator").strip("/")
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
