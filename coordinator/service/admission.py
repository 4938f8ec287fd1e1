"""What a submitted job's parameters may be, decided without touching the disk.

The API process never globs, stats or creates anything a submitter names: a path
parameter is checked for its shape only, and must lie (after `..` and symlinks)
under the operator's root for it: `data` and `eval_data` under `--data-root`,
`artifacts` under `--artifacts-root`. A relative path is taken from its root and
stored absolute, so the members read exactly what was checked. The members
check again when they read (each matched file, symlinks followed, through
`COORDINATOR_DATA_ROOT` and `COORDINATOR_ARTIFACTS_ROOT`), which also covers a
glob's matches and a link made after the submit.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.datasets.source import BUILTINS, DATA_ROOT_ENV
from coordinator.field_error import FieldError
from coordinator.jobs import COMMAND
from coordinator.jobs.environment import WORKING_DIR_ROOT_ENV
from coordinator.jobs.kinds import KINDS, kind_of
from coordinator.jobs.params import ARTIFACTS_ROOT_ENV
from coordinator.jobs.threads import check_thread_caps
from coordinator.service.images import ImagePolicy
from coordinator.service.launchers import OWN_SLOTS, WorkerLauncher
from coordinator.service.model import JobSpec, Launcher

DATA_FIELDS = ("data", "eval_data")
ARTIFACTS_FIELD = "artifacts"
#: The `serve` option that sets the root of each path field.
ROOT_OPTIONS = {"working_dir": "--working-dir-root", ARTIFACTS_FIELD: "--artifacts-root"}
MNIST_BUILTIN = "digits"
MAX_SYNTHETIC_ROWS = 5_000_000
MAX_SYNTHETIC_FEATURES = 2_000
MAX_SYNTHETIC_CELLS = 50_000_000  # rows x features: 200 MB of float32 over all members
MAX_PATH_CHARS = 1024
_SYNTHETIC = re.compile(r"synthetic:(\d+)x(\d+)(?::\d+)?")
_GLOB_CHARS = ("*", "?", "[")


class Refused(FieldError):
    """A parameter the API does not accept; `field` names it (e.g. `params.data`)."""


@dataclass(frozen=True)
class Roots:
    """The operator's folders that submitted paths must stay in."""

    data: Path
    artifacts: Path
    working_dir: Path = Path(os.path.realpath("work"))

    @classmethod
    def of(cls, data: Path, artifacts: Path, working_dir: Path | None = None) -> Roots:
        work = Path(os.path.realpath(working_dir or "work"))
        return cls(Path(os.path.realpath(data)), Path(os.path.realpath(artifacts)), work)

    @classmethod
    def from_environment(cls) -> Roots:
        """The roots `coordinator serve` exported for its members (else ./data, ./artifacts,
        ./work)."""
        return cls.of(
            Path(os.environ.get(DATA_ROOT_ENV) or "data"),
            Path(os.environ.get(ARTIFACTS_ROOT_ENV) or "artifacts"),
            Path(os.environ.get(WORKING_DIR_ROOT_ENV) or "work"),
        )

    def environment(self) -> dict[str, str]:
        """The variables `from_environment` reads them back from (what members inherit)."""
        return {
            DATA_ROOT_ENV: str(self.data),
            ARTIFACTS_ROOT_ENV: str(self.artifacts),
            WORKING_DIR_ROOT_ENV: str(self.working_dir),
        }


@dataclass(frozen=True)
class Policy:
    """What the operator lets a submission ask for (`coordinator serve`'s options)."""

    launchers: Mapping[Launcher, WorkerLauncher]
    max_workers: int  # the service's own slots (local and docker members)
    roots: Roots
    max_threads: int  # per member
    default_launcher: Launcher = Launcher.LOCAL  # for specs that name none
    local_gpus: int = 0  # `serve --gpus`
    # The images each container launcher may run a `command` job in (none: not enabled).
    images: Mapping[Launcher, ImagePolicy] = field(default_factory=dict)


def admit(spec: JobSpec, policy: Policy) -> JobSpec:
    """The spec as it is stored (its launcher, its paths absolute under their roots, its
    id), or Refused naming the field: a job that could never run, or may not, is refused
    before anything starts."""
    if spec.kind not in KINDS:
        raise Refused("kind", f"unknown job kind {spec.kind!r} (known: {', '.join(KINDS)})")
    if "launcher" not in spec.model_fields_set:
        spec = spec.model_copy(update={"launcher": policy.default_launcher})
    launcher = policy.launchers.get(spec.launcher)
    if launcher is None:
        known = ", ".join(policy.launchers)
        raise Refused("launcher", f"launcher {spec.launcher} is not enabled here ({known})")
    if spec.launcher in OWN_SLOTS and spec.workers > policy.max_workers:
        raise Refused(
            "workers",
            f"{spec.workers} workers can never fit: the service has {policy.max_workers} slots",
        )
    admit_gpus(spec, policy.local_gpus)
    if why := launcher.never_fits(spec):
        raise Refused("gpus_per_worker" if spec.gpus_per_worker else "workers", why)
    spec = admit_command(spec, policy.roots, policy.images.get(spec.launcher))
    params = admit_params(spec.kind, spec.params, policy.roots)
    if params != spec.params:
        spec = spec.model_copy(update={"params": params})
    try:
        check_thread_caps(spec.kind, KINDS[spec.kind].params, spec.params, policy.max_threads)
    except FieldError as exc:
        raise Refused(exc.field, str(exc)) from None
    try:
        check_kind(spec.kind, spec.params, spec.workers)
    except ValueError as exc:
        raise Refused("params", str(exc)) from None
    if not spec.id:
        spec = spec.model_copy(update={"id": f"{spec.kind}-{uuid.uuid4().hex[:10]}"})
    return spec


#: The launchers that can run a `command` job's program.
COMMAND_LAUNCHERS = ("local", "agents", "docker", "kubernetes")
#: Where a `command` job's members are containers: its folder is inside the image.
CONTAINER_LAUNCHERS = ("docker", "kubernetes")
COMMAND_FIELDS = ("command", "env", "working_dir", "image")
#: The launchers that can give a member whole GPUs (and local, with `serve --gpus`).
GPU_LAUNCHERS = ("agents", "kubernetes")


def admit_gpus(spec: JobSpec, local_gpus: int) -> None:
    """Refused for GPUs on a launcher that cannot place them (naming `launcher`), or more
    than the service's own `--gpus` for local members (naming `gpus_per_worker`)."""
    wanted = spec.gpus_per_worker
    if wanted == 0 or spec.launcher.value in GPU_LAUNCHERS:
        return
    if spec.launcher.value != "local" or local_gpus == 0:
        raise Refused(
            "launcher",
            f"gpus_per_worker needs the {' or '.join(GPU_LAUNCHERS)} launcher, or local "
            f"with serve --gpus; not {spec.launcher.value}",
        )
    if spec.workers * wanted > local_gpus:
        raise Refused(
            "gpus_per_worker",
            f"{spec.workers} workers with {wanted} GPU(s) each can never fit: the service "
            f"offers {local_gpus} GPUs (serve --gpus)",
        )


def admit_command(spec: JobSpec, roots: Roots, images: ImagePolicy | None = None) -> JobSpec:
    """The spec with its working_dir made absolute under its root; Refused naming the field
    for a `command` job without a program, on a launcher that cannot run one, with a folder
    outside the root, or another kind's spec that carries the command fields. On a
    container launcher (`images`: its policy) the folder is the container's, and the
    image must be one the service allows."""
    if not kind_of(spec.kind).takes_command:
        for name in COMMAND_FIELDS:
            if name in spec.model_fields_set and getattr(spec, name):
                raise Refused(name, f"{name}: only a {COMMAND} job takes it, not {spec.kind}")
        return spec
    if not spec.command or not spec.command[0].strip():
        raise Refused("command", f"command: a {spec.kind} job needs a program: [PROGRAM, ARGS...]")
    if spec.launcher not in COMMAND_LAUNCHERS:
        raise Refused(
            "launcher",
            f"launcher {spec.launcher}: a {spec.kind} job runs on {', '.join(COMMAND_LAUNCHERS)}",
        )
    if spec.launcher in CONTAINER_LAUNCHERS:
        return _admit_in_container(spec, images)
    if spec.image is not None:
        raise Refused(
            "image",
            f"image: only a container launcher ({', '.join(CONTAINER_LAUNCHERS)}) "
            "runs a job in an image",
        )
    if spec.working_dir is None:  # the root itself (the launcher's members run there)
        return spec
    try:
        folder = confine("working_dir", spec.working_dir, roots.working_dir)
    except Refused as exc:
        raise Refused("working_dir", str(exc)) from None
    if any(char in folder for char in _GLOB_CHARS):
        raise Refused("working_dir", f"working_dir: {spec.working_dir!r}: no globs in a folder")
    # On this host (local members): the folder must be there now, not at run time. An
    # agent's host is looked at by the agent.
    if spec.launcher == Launcher.LOCAL and not os.path.isdir(folder):
        raise Refused(
            "working_dir",
            f"working_dir: {folder} is not a folder: make it (mkdir -p {folder}) and put "
            "the program's files there, or give an existing one under "
            f"{roots.working_dir}",
        )
    return spec.model_copy(update={"working_dir": folder})


def _admit_in_container(spec: JobSpec, images: ImagePolicy | None) -> JobSpec:
    """A container's `command` job: an allowed image; a folder that is absolute, without
    `..` (it is the container's working directory, inside the image: nothing to look at
    here)."""
    if images is None:
        raise Refused("launcher", f"launcher {spec.launcher}: not enabled here")
    try:
        images.check(spec.image)
    except ValueError as exc:
        raise Refused("image", f"image: {exc}") from None
    folder = spec.working_dir
    if folder is not None and (
        not folder.startswith("/") or ".." in folder.split("/") or "\0" in folder
    ):
        raise Refused("working_dir", f"working_dir: {folder[:80]!r}: an absolute path without '..'")
    return spec


def admit_params(kind: str, params: dict[str, str], roots: Roots) -> dict[str, str]:
    """The parameters with every path made absolute under its root; Refused naming the
    field for a path outside it, a malformed one, or a synthetic data set too large."""
    admitted = dict(params)
    for name in DATA_FIELDS:
        if name in params:
            admitted[name] = _data_source(kind, name, params[name], roots.data)
    if ARTIFACTS_FIELD in params and params[ARTIFACTS_FIELD].strip():
        admitted[ARTIFACTS_FIELD] = confine(
            ARTIFACTS_FIELD, params[ARTIFACTS_FIELD], roots.artifacts
        )
    return admitted


def check_kind(kind: str, params: dict[str, str], workers: int) -> None:
    """The kind's own parameter checks, reading no file (a ValueError names the field)."""
    from coordinator.jobs.kinds import kind_of

    kind_of(kind).check(params, workers)


def confine(field: str, text: str, root: Path) -> str:
    """`text` as an absolute path under `root` (symlinks resolved), or Refused naming the
    field. Looks at nothing but the path's own links; globs only in the last part."""
    where = f"params.{field}"
    text = text.strip()
    if not text or len(text) > MAX_PATH_CHARS or "\0" in text:
        raise Refused(where, f"{field}: a path of 1 to {MAX_PATH_CHARS} characters is needed")
    if text.startswith("~"):
        raise Refused(where, f"{field}: {text!r}: give a path under {root}, not from a home")
    path = Path(text) if os.path.isabs(text) else root / text
    parts = path.parts
    if ".." in parts:
        raise Refused(where, f"{field}: {text!r}: '..' is not allowed")
    if any(char in part for part in parts[:-1] for char in _GLOB_CHARS):
        raise Refused(where, f"{field}: {text!r}: a glob may only be in the file name")
    resolved = os.path.realpath(path)
    if os.path.commonpath([resolved, root]) != str(root):
        raise Refused(
            where,
            f"{field}: {text!r} is outside {root}, the service's root for it: put it under "
            f"{root}, or start serve with {ROOT_OPTIONS.get(field, '--data-root')} set to a "
            "folder above it",
        )
    return str(path)


def _data_source(kind: str, field: str, text: str, root: Path) -> str:
    stripped = text.strip()
    if kind == "mnist" and stripped == MNIST_BUILTIN:
        return text
    if stripped in BUILTINS:
        return text
    if stripped.startswith("synthetic:"):
        match = _SYNTHETIC.fullmatch(stripped)
        if match is not None:  # a malformed one is the job's own check to name
            rows, features = int(match[1]), int(match[2])
            if (
                rows > MAX_SYNTHETIC_ROWS
                or features > MAX_SYNTHETIC_FEATURES
                or rows * features > MAX_SYNTHETIC_CELLS
            ):
                raise Refused(
                    f"params.{field}",
                    f"{field}: {stripped} is too large here: at most {MAX_SYNTHETIC_ROWS:,} rows, "
                    f"{MAX_SYNTHETIC_FEATURES:,} features and {MAX_SYNTHETIC_CELLS:,} cells",
                )
        return text
    if not any(sep in stripped for sep in ("/", ".", os.sep)):
        return text  # a bare word: an unknown builtin, which the job's check names
    return confine(field, text, root)
