"""`WorkerCommand`: one member's `coordinator worker` invocation, as data.

Everything that starts a member (`run`, the service's launchers, an agent, the
benchmarks) builds one and renders it: `argv()` holds only what may be public
(ids, endpoints, kind, parameters, the program's arguments); `env()` holds the
rest (the etcd user and the files of its password and certificates, the
program's variables and folder, the member's GPUs). `from_argv` reads both back,
checked, so the agent and the Kubernetes launcher validate what they are handed
with the same rules the service rendered it by.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from coordinator.etcd.security import ENV as ETCD_ENV
from coordinator.jobs import MEMBER_KINDS
from coordinator.jobs.environment import GPUS_ENV, PROGRAM_DIR, PROGRAM_ENV

MAX_GPU_ID = 1023
MAX_GPUS = 64

#: argv option -> (field, may repeat). Only these travel in argv; secrets never do.
_OPTIONS = {
    "--job": ("job_id", False),
    "--world-size": ("world_size", False),
    "--etcd": ("etcd", False),
    "--namespace": ("namespace", False),
    "--kind": ("kind", False),
    "--ttl": ("ttl", False),
    "--timeout": ("timeout", False),
    "--connect-timeout": ("connect_timeout", False),
    "--param": ("params", True),
}
#: field -> the variable it travels in (file paths and a user name, never a password).
_SECURITY_ENV = {
    "etcd_user": ETCD_ENV["user"],
    "etcd_password_file": ETCD_ENV["password_file"],
    "etcd_ca": ETCD_ENV["ca"],
    "etcd_cert": ETCD_ENV["cert"],
    "etcd_key": ETCD_ENV["key"],
}


def parse_gpus(text: str) -> tuple[int, ...]:
    """`"0,1,3"` as GPU ids; ValueError naming the problem (not small non-negative
    whole numbers, or one given twice). Empty text: none."""
    if not text.strip():
        return ()
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) > MAX_GPU_ID:
            raise ValueError(f"GPU id {part!r} is not a whole number of 0..{MAX_GPU_ID}")
        ids.append(int(part))
    return check_gpus(ids)


def check_gpus(ids: Sequence[int]) -> tuple[int, ...]:
    """GPU ids, each in 0..MAX_GPU_ID and given once (ValueError otherwise)."""
    if len(ids) > MAX_GPUS:
        raise ValueError(f"at most {MAX_GPUS} GPUs")
    for gpu in ids:
        if isinstance(gpu, bool) or not 0 <= gpu <= MAX_GPU_ID:
            raise ValueError(f"GPU id {gpu!r} is not a whole number of 0..{MAX_GPU_ID}")
    repeated = sorted({gpu for gpu in ids if list(ids).count(gpu) > 1})
    if repeated:
        raise ValueError(f"GPU ids given more than once: {repeated}")
    return tuple(ids)


class WorkerCommand(BaseModel):
    """One member's `coordinator worker` invocation. None: the worker's default (or what
    the member's inherited environment says)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: Annotated[str, Field(min_length=1, max_length=253)]
    world_size: Annotated[int, Field(ge=1)]
    etcd: Annotated[str, Field(min_length=1)] | None = None  # endpoints, comma-separated
    namespace: str | None = None
    kind: str | None = None
    ttl: Annotated[int, Field(ge=2)] | None = None
    timeout: Annotated[float, Field(gt=0)] | None = None
    connect_timeout: Annotated[float, Field(gt=0)] | None = None
    params: dict[str, str] = Field(default_factory=dict)
    # The command kind: the program and its arguments (one list), its variables and folder.
    program: tuple[str, ...] | None = None
    program_env: dict[str, str] = Field(default_factory=dict)
    working_dir: str | None = None
    gpus: tuple[int, ...] = ()
    # The member's etcd settings: a user and files (the password's, TLS's).
    etcd_user: str | None = None
    etcd_password_file: str | None = None
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str | None) -> str | None:
        if kind is not None and kind not in MEMBER_KINDS:
            raise ValueError(f"--kind {kind!r} is not a job kind")
        return kind

    @field_validator("params")
    @classmethod
    def _param_names(cls, params: dict[str, str]) -> dict[str, str]:
        for name in params:
            if not name or "=" in name:
                raise ValueError(f"--param name {name!r} is empty or holds '='")
        return params

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, gpus: tuple[int, ...]) -> tuple[int, ...]:
        return check_gpus(gpus)

    # -- rendering ------------------------------------------------------------------------

    def options(self) -> list[str]:
        """The worker's options (`--name value` pairs), without the program."""
        args = ["--job", self.job_id, "--world-size", str(self.world_size)]
        for flag, value in (
            ("--etcd", self.etcd),
            ("--namespace", self.namespace),
            ("--kind", self.kind),
            ("--ttl", self.ttl),
            ("--timeout", self.timeout),
            ("--connect-timeout", self.connect_timeout),
        ):
            if value is not None:
                args += [flag, str(value)]
        for name, value in self.params.items():
            args += ["--param", f"{name}={value}"]
        return args

    def argv(self) -> list[str]:
        """`coordinator worker`'s arguments: the options, then `-- PROGRAM ARGS...` (a
        list, never split or joined)."""
        args = self.options()
        return args if self.program is None else [*args, "--", *self.program]

    def process_argv(self) -> list[str]:
        """The whole command line of a local member process."""
        return [sys.executable, "-m", "coordinator", "worker", *self.argv()]

    def env(self) -> dict[str, str]:
        """The variables the member needs beyond its argv: its etcd user and files, its
        program's variables (JSON) and folder, its GPUs. Values may be secrets."""
        env = {var: getattr(self, name) for name, var in _SECURITY_ENV.items()}
        env = {var: value for var, value in env.items() if value is not None}
        if self.program_env:
            env[PROGRAM_ENV] = json.dumps(self.program_env)
        if self.working_dir:
            env[PROGRAM_DIR] = self.working_dir
        if self.gpus:
            env[GPUS_ENV] = ",".join(str(gpu) for gpu in self.gpus)
        return env

    def with_etcd(self, endpoints: str) -> WorkerCommand:
        """The same command, reaching etcd at `endpoints` (a container's or pod's view)."""
        return self.model_copy(update={"etcd": endpoints})

    # -- parsing ----------------------------------------------------------------------------

    @classmethod
    def from_argv(cls, argv: Sequence[str], env: Mapping[str, str] | None = None) -> WorkerCommand:
        """The command `argv()` and `env()` rendered, checked: options are `--name value`
        pairs of the ones above (each once, `--param` repeating), then an optional
        `-- PROGRAM...`; ValueError names what is wrong. `env`: only our variables are read."""
        fields: dict[str, object] = {"params": {}}
        args = list(argv)
        i = 0
        while i < len(args):
            name = args[i]
            if name == "--":
                fields["program"] = tuple(args[i + 1 :])
                break
            if name not in _OPTIONS:
                raise ValueError(f"{name!r} is not an option members are given")
            if i + 1 >= len(args):
                raise ValueError(f"{name} has no value (options are --name value pairs)")
            value = args[i + 1]
            field, repeats = _OPTIONS[name]
            if field == "params":
                key, sep, param = value.partition("=")
                if not sep or not key:
                    raise ValueError(f"--param {value!r} is not KEY=VALUE")
                fields["params"][key] = param  # type: ignore[index]
            elif field in fields and not repeats:
                raise ValueError(f"{name} is given more than once")
            else:
                fields[field] = value
            i += 2
        for required in ("job_id", "world_size"):
            if required not in fields:
                raise ValueError(f"--{required.replace('_', '-').replace('-id', '')} is missing")
        env = env or {}
        for name, var in _SECURITY_ENV.items():
            if env.get(var):
                fields[name] = env[var]
        if env.get(PROGRAM_ENV):
            try:
                fields["program_env"] = json.loads(env[PROGRAM_ENV])
            except ValueError:
                raise ValueError(f"${PROGRAM_ENV} is not JSON") from None
        if env.get(PROGRAM_DIR):
            fields["working_dir"] = env[PROGRAM_DIR]
        if env.get(GPUS_ENV):
            fields["gpus"] = parse_gpus(env[GPUS_ENV])
        return cls.model_validate(fields)
