"""Kubernetes manifests for one job: the YAML in `k8s/`, with N, the job id and the image set.

The files in `k8s/` are the source of truth (`kubectl apply -k k8s/` works on them
directly); `render` only fills in the values that change from job to job, so
what a user renders and what the repository ships cannot drift apart.
"""

from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path
from typing import Any

import yaml

from coordinator.etcd.client import parse_endpoints
from coordinator.jobs import JOB_KINDS
from coordinator.rendezvous.member import check_name

#: The repository's `k8s/` folder: the repository root is the parent of `coordinator/`.
MANIFEST_DIR = Path(__file__).resolve().parents[2] / "k8s"
DEFAULT_IMAGE = "etcd-coordinator:latest"
DEFAULT_NAMESPACE = "/coordinator"
#: Kubernetes caps an Indexed Job's completions (and parallelism) at 10^5.
MAX_WORKERS = 100_000

Manifest = dict[str, Any]


class InvalidValue(ValueError):
    """A bad render input; `field` names the option so the CLI can point at it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def manifest_dir() -> Path:
    """The `k8s/` folder, or a FileNotFoundError saying where it was expected and why."""
    if not (MANIFEST_DIR / "kustomization.yaml").is_file():
        raise FileNotFoundError(
            f"Kubernetes manifests not found at {MANIFEST_DIR} (expected k8s/kustomization.yaml "
            "next to the coordinator package; use a source checkout or `pip install -e .`)"
        )
    return MANIFEST_DIR


def load(folder: Path | None = None) -> list[Manifest]:
    """Every document of the files that `k8s/kustomization.yaml` lists, in its order.

    Reading the kustomization's `resources` (not a glob) keeps this the same set of
    objects that `kubectl apply -k` would create.
    """
    folder = folder or manifest_dir()
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[Manifest] = []
    for resource in kustomization.get("resources", []):
        path = folder / resource
        if not path.is_file():
            raise FileNotFoundError(f"{folder / 'kustomization.yaml'} lists missing {path}")
        docs.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


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


def _check(
    workers: int, job: str, image: str, etcd: str | None, kind: str, params: str
) -> str | None:
    """Validate the inputs; return the normalised etcd endpoints (or None)."""
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise InvalidValue("workers", f"workers must be an integer, not {workers!r}")
    if not 1 <= workers <= MAX_WORKERS:
        raise InvalidValue("workers", f"workers must be between 1 and {MAX_WORKERS}, not {workers}")
    try:
        check_name("job id", job)
    except ValueError as exc:
        raise InvalidValue("job", str(exc)) from None
    if not image or any(c.isspace() for c in image):
        raise InvalidValue("image", f"image {image!r} must be a non-empty image reference")
    if kind not in JOB_KINDS:
        raise InvalidValue("kind", f"kind {kind!r} is not one of: {', '.join(sorted(JOB_KINDS))}")
    if "\n" in params or "\r" in params:
        raise InvalidValue("params", f"params must be one line (KEY=VALUE,...), not {params!r}")
    if etcd is None:
        return None
    try:
        endpoints = parse_endpoints(etcd)
    except ValueError as exc:
        raise InvalidValue("etcd", str(exc)) from None
    return ",".join(endpoints)


def _is_bundled_etcd(doc: Manifest) -> bool:
    return doc["kind"] in ("StatefulSet", "Service") and doc["metadata"]["name"] == "etcd"


def render(
    workers: int,
    job: str,
    image: str = DEFAULT_IMAGE,
    etcd: str | None = None,
    namespace_prefix: str = DEFAULT_NAMESPACE,
    kind: str = "noop",
    params: str = "",
) -> list[Manifest]:
    """The manifests for one job of `workers` members.

    `params` is the job's COORDINATOR_PARAMS (KEY=VALUE,..., e.g. `epochs=3` for mnist).
    With `etcd`, the bundled etcd is left out and the workers use those endpoints.
    Raises InvalidValue (a ValueError naming the field) for bad input.
    """
    endpoints = _check(workers, job, image, etcd, kind, params)
    docs = copy.deepcopy(load())
    if endpoints is not None:
        docs = [doc for doc in docs if not _is_bundled_etcd(doc)]
    jobs = [doc for doc in docs if doc["kind"] == "Job"]
    if len(jobs) != 1:
        raise ValueError(f"expected exactly one Job in {MANIFEST_DIR}, found {len(jobs)}")
    spec = jobs[0]["spec"]
    jobs[0]["metadata"]["name"] = job_name(job)
    spec["parallelism"] = spec["completions"] = workers
    values = {
        "COORDINATOR_JOB": job,
        "COORDINATOR_WORLD_SIZE": str(workers),
        "COORDINATOR_KIND": kind,
        "COORDINATOR_NAMESPACE": namespace_prefix,
        "COORDINATOR_PARAMS": params,
    }
    if endpoints is not None:
        values["COORDINATOR_ETCD"] = endpoints
    pod = spec["template"]["spec"]
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        container["image"] = image
        for var in container.get("env", []):
            if var["name"] in values:
                var["value"] = values[var["name"]]
    return docs


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (the init container's script) as readable `|` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(docs: list[Manifest]) -> str:
    """Multi-document YAML, keys in manifest order, for `kubectl apply -f -`."""
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
