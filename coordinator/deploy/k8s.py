"""Kubernetes manifests: the YAML in `k8s/`, and one job's Indexed Job filled in from it.

The files in `k8s/` are the source of truth (`kubectl apply -k k8s/` works on them
directly). `worker_job` fills in the values that change from job to job in the
Job template of `k8s/job.yaml`; `coordinator k8s` (`render`) and the service's
`kubernetes` launcher both build their Job with it, so what a user renders, what
the service creates and what the repository ships cannot drift apart.

A job's pods connect to etcd as the job's own etcd user, from a Secret named after
the Job (`credentials_secret`, keys `user` and `password`): the launcher creates it
with the Job (`credentials_secret_body`), owned by it.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from coordinator.etcd.connection import parse_endpoints
from coordinator.etcd.names import check_name
from coordinator.field_error import FieldError
from coordinator.jobs import MEMBER_KINDS

#: The repository's `k8s/` folder: the repository root is the parent of `coordinator/`.
MANIFEST_DIR = Path(__file__).resolve().parents[2] / "k8s"
DEFAULT_IMAGE = "etcd-coordinator:latest"
DEFAULT_NAMESPACE = "/coordinator"
#: Kubernetes caps an Indexed Job's completions (and parallelism) at 10^5.
MAX_WORKERS = 100_000
#: The files of one job's objects (what `render` prints): etcd, the workers' Service,
#: the artifacts volume and the Job. The rest of the kustomization (the service, the
#: agents, the policies) is the standing product, applied once.
JOB_FILES = ("etcd.yaml", "workers.yaml", "job.yaml")
#: The file whose Job is the template of every job's members (not applied by itself).
WORKERS_FILE = "job.yaml"
#: A folder holding `job.yaml` where the package has no `k8s/` next to it (an
#: installed image): the service's Deployment mounts it from a ConfigMap.
MANIFESTS_ENV = "COORDINATOR_MANIFESTS"

Manifest = dict[str, Any]


class InvalidValue(FieldError):
    """A bad render input; `field` names the option so the CLI can point at it."""


def manifest_dir() -> Path:
    """The `k8s/` folder, or a FileNotFoundError saying where it was expected and why."""
    if not (MANIFEST_DIR / "kustomization.yaml").is_file():
        raise FileNotFoundError(
            f"Kubernetes manifests not found at {MANIFEST_DIR} (expected k8s/kustomization.yaml "
            "next to the coordinator package; use a source checkout or `pip install -e .`)"
        )
    return MANIFEST_DIR


def load(folder: Path | None = None) -> list[Manifest]:
    """Every object `kubectl apply -k` creates from the kustomization, in its order.

    Reading the kustomization's `resources` (not a glob) keeps this the same set of
    objects; its `configMapGenerator` entries (files as data, no hash suffix) follow.
    """
    folder = folder or manifest_dir()
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[Manifest] = []
    for resource in kustomization.get("resources", []):
        docs.extend(_documents(folder, resource))
    for generator in kustomization.get("configMapGenerator", []):
        docs.append(_config_map(folder, generator))
    return docs


def _documents(folder: Path, name: str) -> list[Manifest]:
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(f"{folder / 'kustomization.yaml'} lists missing {path}")
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _config_map(folder: Path, generator: dict[str, Any]) -> Manifest:
    """The ConfigMap kustomize generates from whole files (the only form used here)."""
    options = generator.get("options", {})
    if not options.get("disableNameSuffixHash") or set(generator) - {"name", "files", "options"}:
        raise ValueError(f"configMapGenerator {generator.get('name')!r}: only files, no hash")
    data = {}
    for name in generator["files"]:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{folder / 'kustomization.yaml'} lists missing {path}")
        data[path.name] = path.read_text()
    metadata: Manifest = {"name": generator["name"]}
    if options.get("labels"):
        metadata["labels"] = dict(options["labels"])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


#: The pod template's volume of the job's etcd credentials, and the variable of its user.
CREDENTIALS_VOLUME = "etcd-credentials"
USER_ENV = "COORDINATOR_ETCD_USER"
PASSWORD_FILE_ENV = "COORDINATOR_ETCD_PASSWORD_FILE"


def credentials_secret(job_name: str) -> str:
    """The Secret holding the etcd user of the Job `job_name`'s pods (fits 253 chars)."""
    return f"{job_name}-etcd"


def credentials_secret_body(
    name: str, user: str, password: str, owner: Manifest, labels: dict[str, str]
) -> Manifest:
    """The Secret of a Job's etcd user, owned by the Job (`owner`, as the API returned it,
    with its uid): Kubernetes deletes it with the Job."""
    metadata = owner.get("metadata") or {}
    if not metadata.get("uid") or not metadata.get("name"):
        raise ValueError("the owner Job has no name or uid (not as the API returned it)")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": name,
            "labels": dict(labels),
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": metadata["name"],
                    "uid": metadata["uid"],
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "data": {
            "user": base64.b64encode(user.encode()).decode(),
            "password": base64.b64encode(password.encode()).decode(),
        },
    }


def _set_credentials(pod: Manifest, secret: str | None) -> None:
    """Point the pod's credentials volume and user variable at `secret`; with None, take
    them out (an etcd without auth: the pods connect without a user)."""
    volumes = pod.get("volumes", [])
    mounted = [v for v in volumes if v["name"] == CREDENTIALS_VOLUME]
    for volume in mounted:
        volume["secret"]["secretName"] = secret
    if secret is None:
        pod["volumes"] = [v for v in volumes if v["name"] != CREDENTIALS_VOLUME]
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        if secret is None:
            container["env"] = [
                var
                for var in container.get("env", [])
                if var["name"] not in (USER_ENV, PASSWORD_FILE_ENV)
            ]
            mounts = container.get("volumeMounts", [])
            container["volumeMounts"] = [m for m in mounts if m["name"] != CREDENTIALS_VOLUME]
            continue
        for var in container.get("env", []):
            reference = (var.get("valueFrom") or {}).get("secretKeyRef")
            if var["name"] == USER_ENV and reference is not None:
                reference["name"] = secret


def job_manifests(folder: Path | None = None) -> list[Manifest]:
    """The objects of one job (`JOB_FILES`), as shipped."""
    folder = folder or manifest_dir()
    return [doc for name in JOB_FILES for doc in _documents(folder, name)]


def job_template(folder: Path | None = None) -> Manifest:
    """The Job of `job.yaml`: from `folder`, else $COORDINATOR_MANIFESTS, else `k8s/`.

    The service's kubernetes launcher reads it once when it starts; in an image without
    the repository, the Deployment mounts the file there from a ConfigMap.
    """
    if folder is None and os.environ.get(MANIFESTS_ENV):
        folder = Path(os.environ[MANIFESTS_ENV])
    if folder is None:
        folder = manifest_dir()
    elif not (folder / WORKERS_FILE).is_file():
        raise FileNotFoundError(
            f"Kubernetes Job template not found at {folder / WORKERS_FILE} "
            f"(the folder comes from ${MANIFESTS_ENV} or the launcher's `manifests`)"
        )
    return _only_job(_documents(folder, WORKERS_FILE), folder / WORKERS_FILE)


def _only_job(docs: list[Manifest], where: Path) -> Manifest:
    jobs = [doc for doc in docs if doc["kind"] == "Job"]
    if len(jobs) != 1:
        raise ValueError(f"expected exactly one Job in {where}, found {len(jobs)}")
    return jobs[0]


def job_name(job: str) -> str:
    """A DNS-1123 Job name for a job id (which may hold capitals, `.` and `_`).

    Pod hostnames are `<job-name>-<index>` and must fit in 63 characters, so the id
    is shortened; a hash of the id is appended whenever it had to change, so two
    ids that differ only in case or punctuation still get different names.
    """
    slug = re.sub(r"[^a-z0-9-]+", "-", job.lower())[:30].strip("-")
    name = f"coordinator-{slug}"
    if slug != job:
        name += "-" + hashlib.sha256(job.encode()).hexdigest()[:6]
    return name


@dataclass(frozen=True)
class WorkerPods:
    """One job's worker pods: how many, of which job, from which image, reaching which
    etcd (None: the bundled one), under which namespace prefix, running which kind with
    which parameters (`KEY=VALUE,...`). Checked when made: InvalidValue names the field."""

    workers: int
    job: str
    image: str = DEFAULT_IMAGE
    etcd: str | None = None
    namespace_prefix: str = DEFAULT_NAMESPACE
    kind: str = "noop"
    params: str = ""

    def __post_init__(self) -> None:
        workers = self.workers
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise InvalidValue("workers", f"workers must be an integer, not {workers!r}")
        if not 1 <= workers <= MAX_WORKERS:
            raise InvalidValue(
                "workers", f"workers must be between 1 and {MAX_WORKERS}, not {workers}"
            )
        try:
            check_name("job id", self.job)
        except ValueError as exc:
            raise InvalidValue("job", str(exc)) from None
        if not self.image or any(c.isspace() for c in self.image):
            raise InvalidValue("image", f"image {self.image!r} must be a non-empty image reference")
        if self.kind not in MEMBER_KINDS:
            known = ", ".join(sorted(MEMBER_KINDS))
            raise InvalidValue("kind", f"kind {self.kind!r} is not one of: {known}")
        if "\n" in self.params or "\r" in self.params:
            raise InvalidValue(
                "params", f"params must be one line (KEY=VALUE,...), not {self.params!r}"
            )
        self.endpoints  # noqa: B018 (checked now, not when first used)

    @cached_property
    def endpoints(self) -> str | None:
        """The normalised etcd endpoints (None: the bundled etcd)."""
        if self.etcd is None:
            return None
        try:
            endpoints = parse_endpoints(self.etcd)
        except ValueError as exc:
            raise InvalidValue("etcd", str(exc)) from None
        return ",".join(endpoints)


def _is_bundled_etcd(doc: Manifest) -> bool:
    return doc["kind"] in ("StatefulSet", "Service") and doc["metadata"]["name"] == "etcd"


def render(pods: WorkerPods) -> list[Manifest]:
    """The manifests for one job's worker pods (`coordinator k8s`).

    With `pods.etcd`, the bundled etcd is left out and the workers use those endpoints.
    The pods read their etcd user from the Secret `<job name>-etcd`, which the one who
    applies them creates (docs/kubernetes.md).
    """
    docs = job_manifests()
    if pods.endpoints is not None:
        docs = [doc for doc in docs if not _is_bundled_etcd(doc)]
    template = _only_job(docs, MANIFEST_DIR)
    docs[docs.index(template)] = worker_job(pods, template=template)
    return docs


def worker_job(
    pods: WorkerPods,
    *,
    template: Manifest | None = None,
    name: str | None = None,
    args: list[str] | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    grace_seconds: int | None = None,
    credentials: bool = True,
) -> Manifest:
    """The Indexed Job of `pods`: `template` (the Job of `job.yaml` when None) with N,
    the job id, the image and the environment set.

    The launcher also gives `name` (one Job per attempt, `job_name(job)` otherwise),
    the worker's `args` (`["worker", ...]`: its options win over the environment),
    `labels` and `annotations` for the Job and its pods (to find them again), and the
    pods' `grace_seconds` from SIGTERM to SIGKILL. The pods' etcd user comes from the
    Secret `credentials_secret(name)`; `credentials=False` leaves it out (an etcd
    without auth).
    """
    result = copy.deepcopy(template if template is not None else job_template())
    metadata = result["metadata"]
    metadata["name"] = name or job_name(pods.job)
    spec = result["spec"]
    spec["parallelism"] = spec["completions"] = pods.workers
    pod_template = spec["template"]
    for target in (metadata, pod_template.setdefault("metadata", {})):
        if labels:
            target["labels"] = {**target.get("labels", {}), **labels}
        if annotations:
            target["annotations"] = {**target.get("annotations", {}), **annotations}
    values = {
        "COORDINATOR_JOB": pods.job,
        "COORDINATOR_WORLD_SIZE": str(pods.workers),
        "COORDINATOR_KIND": pods.kind,
        "COORDINATOR_NAMESPACE": pods.namespace_prefix,
        "COORDINATOR_PARAMS": pods.params,
    }
    if pods.endpoints is not None:
        values["COORDINATOR_ETCD"] = pods.endpoints
    pod = pod_template["spec"]
    _set_credentials(pod, credentials_secret(metadata["name"]) if credentials else None)
    if grace_seconds is not None:
        pod["terminationGracePeriodSeconds"] = grace_seconds
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        container["image"] = pods.image
        for var in container.get("env", []):
            if var["name"] in values:
                var["value"] = values[var["name"]]
    if args is not None:
        (worker,) = (c for c in pod["containers"] if c["name"] == "worker")
        worker["args"] = list(args)
    return result


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (the init container's script) as readable `|` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(docs: list[Manifest]) -> str:
    """Multi-document YAML, keys in manifest order, for `kubectl apply -f -`."""
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
