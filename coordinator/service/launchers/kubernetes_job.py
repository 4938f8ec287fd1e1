"""The Indexed Job and the credentials Secret of an attempt, as the kubernetes launcher
sends them: pure (no API calls), so what is sent can be read and tested on its own.

The Job is built by the same function that renders `coordinator k8s` manifests
(`coordinator.deploy.k8s.worker_job`, from the Job of `k8s/job.yaml`): one per
attempt, `completions = parallelism = N`, its pods running `coordinator worker
<command.argv()>` with the etcd endpoints replaced by those the pods reach. Labels
(`etcd-coordinator/launcher`, `/run`, `/attempt`) find an attempt's Job, pods and
Secret again.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from coordinator.deploy import k8s
from coordinator.etcd.connection import parse_endpoints
from coordinator.jobs.kinds import kind_of
from coordinator.rendezvous.address import endpoint_host, is_loopback
from coordinator.service.images import ImagePolicy
from coordinator.service.launchers import Launch

LABEL_PREFIX = "etcd-coordinator"
LAUNCHER_LABEL = f"{LABEL_PREFIX}/launcher"  # "kubernetes": what this launcher watches
RUN_LABEL = f"{LABEL_PREFIX}/run"  # the submission (hashed when too long for a label)
ATTEMPT_LABEL = f"{LABEL_PREFIX}/attempt"
RUN_ANNOTATION = f"{LABEL_PREFIX}/run-id"  # the submission's run id, whole
SELECTOR = f"{LAUNCHER_LABEL}=kubernetes"
WORKER_CONTAINER = "worker"
GPU_RESOURCE = "nvidia.com/gpu"  # what a pod asks of the NVIDIA device plugin
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def run_label(run_id: str) -> str:
    """`run_id` as a label value (<= 63 characters): shortened with a hash if it must be."""
    if _LABEL_VALUE.match(run_id):
        return run_id
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:12]
    head = re.sub(r"[^-A-Za-z0-9_.]+", "-", run_id)[:50].strip("-_.")
    return f"{head}-{digest}" if head else digest


def job_name(run_id: str, attempt: int) -> str:
    """The Job of attempt `attempt` of `run_id`: a DNS label that leaves room for the
    pods' hostnames (`<job>-<index>`), distinct per submission and attempt."""
    return k8s.job_name(f"{run_id}-a{attempt}")


def pod_endpoints(etcd: str) -> str:
    """The endpoints normalised; loopback refused, since a pod's loopback is its own."""
    endpoints = parse_endpoints(etcd)
    for endpoint in endpoints:
        if is_loopback(endpoint_host(endpoint)):
            raise ValueError(
                f"etcd at {endpoint} is loopback, which pods cannot reach: give the "
                "endpoints as pods see them (e.g. etcd:2379)"
            )
    return ",".join(endpoints)


def attempt_labels(launch: Launch) -> dict[str, str]:
    """The labels of `launch`'s Job and Secret (and, through the Job, its pods)."""
    return {
        LAUNCHER_LABEL: "kubernetes",
        RUN_LABEL: run_label(launch.run_id),
        ATTEMPT_LABEL: str(launch.attempt),
    }


def attempt_job(
    launch: Launch,
    image: str,
    images: ImagePolicy,
    etcd: str,
    namespace: str,
    template: k8s.Manifest,
    grace_seconds: int,
) -> dict[str, Any]:
    """The Job of `launch`'s attempt in `namespace`, its pods from `image` (a `command`
    job's own, if `images` allows it) reaching etcd at `etcd`."""
    command = launch.command.with_etcd(etcd)
    args = ["worker", *command.argv()]
    spec = launch.spec
    # A `command` job's own image, if allowed (checked at submit; again here, as the
    # record came from etcd): ValueError naming it, before the API is asked anything.
    image = images.check(spec.image) if kind_of(spec.kind).takes_command else image
    pods = k8s.WorkerPods(
        spec.workers,
        command.job_id,
        image,
        etcd,
        command.namespace or k8s.DEFAULT_NAMESPACE,
        command.kind or spec.kind,
        "",  # the job's parameters are in `args` (`--param`), which win over the env
    )
    body = k8s.worker_job(
        pods,
        template=template,
        name=job_name(launch.run_id, launch.attempt),
        args=args,
        labels=attempt_labels(launch),
        annotations={RUN_ANNOTATION: launch.run_id},
        grace_seconds=grace_seconds,
        credentials=launch.credentials is not None,
    )
    body["metadata"]["namespace"] = namespace
    pod = body["spec"]["template"]["spec"]
    (worker,) = (c for c in pod["containers"] if c["name"] == WORKER_CONTAINER)
    if spec.gpus_per_worker > 0:  # whole GPUs per pod, from the device plugin
        limits = worker.setdefault("resources", {}).setdefault("limits", {})
        limits[GPU_RESOURCE] = spec.gpus_per_worker
    if kind_of(spec.kind).takes_command:  # the program's variables and folder, inside the image
        # (its name checked at submit: never one the member sets itself)
        taken = {var["name"] for var in worker.get("env", [])}
        worker.setdefault("env", []).extend(
            {"name": name, "value": value}
            for name, value in sorted(spec.env.items())
            if name not in taken
        )
        if spec.working_dir:
            worker["workingDir"] = spec.working_dir
    return body


def credentials_secret(launch: Launch, job: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The name and body of the Secret of `launch`'s etcd user, owned by `job` (the Job
    as the API has it), so Kubernetes deletes it with the Job."""
    assert launch.credentials is not None
    name = k8s.credentials_secret(job_name(launch.run_id, launch.attempt))
    body = k8s.credentials_secret_body(
        name,
        launch.credentials.user,
        launch.credentials.password,
        owner=job,
        labels=attempt_labels(launch),
    )
    return name, body
