"""Members as the pods of an Indexed Job, through the official `kubernetes` client.

Each attempt of a job is ONE Indexed Job (`completions = parallelism = N`,
`backoffLimit: 0`, `restartPolicy: Never`), built by the same function that renders
`coordinator k8s` manifests (`coordinator.deploy.k8s.worker_job`, from the Job of
`k8s/job.yaml`). Kubernetes numbers its pods 0..N-1: member `index` is the pod
with that completion index. `start` creates the Job on the first index it is asked
for (409 AlreadyExists: another replica or a predecessor created it, which is as
good) and returns `Member(container="<namespace>/<job name>/<index>")`, which finds
the pod again from any replica. The pods run `coordinator worker <command.argv()>` (the
image's entrypoint is `coordinator`), with the etcd endpoints replaced by those the
pods reach (`etcd`, e.g. `etcd:2379`). A `command` job's pods run its own image (one the
service allows: `serve --allowed-image`), its `env` in the worker container's
environment and its `working_dir` as the container's folder.

The job's etcd user (`Launch.credentials`) reaches its pods through a Secret
`<job name>-etcd` (keys `user`, `password`) that `start` creates right after the Job,
with the Job as its owner, so Kubernetes deletes it with the Job; the pods mount it
(kubelet waits for it to exist). The password is never in the Job, argv or a log.

The pods' states come from one watch on the pods this launcher created (label
`etcd-coordinator/launcher=kubernetes`), kept in memory by a thread: a member's exit
code is its container's terminated state. `output` reads the pod's log (the API has
no byte offsets: it is read whole and sliced).

Kubernetes errors while following never escape `exit_code`, `output`, `terminate`
or `kill`: they are logged, and the reconciler asks again on its next tick. `start`
raises with a message naming the Job, the namespace and the API's answer.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import re
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from coordinator.deploy import k8s
from coordinator.etcd.connection import parse_endpoints
from coordinator.jobs import COMMAND
from coordinator.rendezvous.address import endpoint_host, is_loopback
from coordinator.service.images import ImagePolicy
from coordinator.service.launchers import NOTHING, VANISHED, Launch, Reservation
from coordinator.service.model import Member

log = logging.getLogger(__name__)

LABEL_PREFIX = "etcd-coordinator"
LAUNCHER_LABEL = f"{LABEL_PREFIX}/launcher"  # "kubernetes": what this launcher watches
RUN_LABEL = f"{LABEL_PREFIX}/run"  # the submission (hashed when too long for a label)
ATTEMPT_LABEL = f"{LABEL_PREFIX}/attempt"
RUN_ANNOTATION = f"{LABEL_PREFIX}/run-id"  # the submission's run id, whole
SELECTOR = f"{LAUNCHER_LABEL}=kubernetes"
#: Where Kubernetes writes an Indexed Job pod's index and Job (labels since 1.27/1.28;
#: the annotation and the old `job-name` label before).
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
JOB_NAME_KEYS = ("batch.kubernetes.io/job-name", "job-name")
WORKER_CONTAINER = "worker"
GPU_RESOURCE = "nvidia.com/gpu"  # what a pod asks of the NVIDIA device plugin
#: Deleted pods remembered for their exit codes (a pod's DELETED event carries its
#: last state) until their submission is removed; the oldest go first beyond this.
MAX_TOMBSTONES = 10_000
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
FOLLOW_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError)


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


def _pod_endpoints(etcd: str) -> str:
    """The endpoints normalised; loopback refused, since a pod's loopback is its own."""
    endpoints = parse_endpoints(etcd)
    for endpoint in endpoints:
        if is_loopback(endpoint_host(endpoint)):
            raise ValueError(
                f"etcd at {endpoint} is loopback, which pods cannot reach: give the "
                "endpoints as pods see them (e.g. etcd:2379)"
            )
    return ",".join(endpoints)


def _api_message(exc: ApiException) -> str:
    """The API server's own words (its Status `message`), else the HTTP reason."""
    try:
        body = json.loads(exc.body or "")
        if isinstance(body, dict) and body.get("message"):
            return f"HTTP {exc.status}: {body['message']}"
    except (TypeError, ValueError):
        pass
    return f"HTTP {exc.status}: {exc.reason}"


@dataclass(frozen=True)
class PodState:
    """What the launcher needs of one pod, as its last event told."""

    name: str
    job: str
    index: int
    created: str  # RFC 3339, UTC: sorts as text
    exit_code: int | None  # None while it runs (or has not started)
    container: str  # whose log `output` reads: the worker's, or the init container that failed
    deleted: bool = False  # gone from the API (its DELETED event, or missing from a relist)


def pod_state(pod: dict[str, Any], deleted: bool = False) -> PodState | None:
    """A pod (its JSON) as a PodState; None if it is no Indexed Job's pod."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    annotations = metadata.get("annotations") or {}
    job = next((labels[key] for key in JOB_NAME_KEYS if labels.get(key)), None)
    index = annotations.get(INDEX_KEY) or labels.get(INDEX_KEY)
    if job is None or index is None or not str(index).isdigit():
        return None
    status = pod.get("status") or {}
    phase = status.get("phase")
    code, container = None, WORKER_CONTAINER
    for entry in status.get("containerStatuses") or []:
        terminated = (entry.get("state") or {}).get("terminated")
        if entry.get("name") == WORKER_CONTAINER and terminated:
            code = int(terminated.get("exitCode", VANISHED))
    if code is None and phase == "Failed":
        code = VANISHED  # evicted, past a deadline, ...: no exit code of its own
        for entry in status.get("initContainerStatuses") or []:
            terminated = (entry.get("state") or {}).get("terminated")
            if terminated and terminated.get("exitCode"):  # e.g. etcd never reachable
                code, container = int(terminated["exitCode"]), entry.get("name", container)
                break
    elif code is None and phase == "Succeeded":
        code = 0
    return PodState(
        name=metadata.get("name", ""),
        job=job,
        index=int(index),
        created=metadata.get("creationTimestamp") or "",
        exit_code=code,
        container=container,
        deleted=deleted,
    )


class KubernetesLauncher:
    def __init__(
        self,
        image: str,
        namespace: str,
        etcd: str,
        api_client: k8s_client.ApiClient | None = None,
        *,
        manifests: Path | None = None,
        grace_seconds: int = 10,
        request_timeout: float = 30.0,
        watch_seconds: int = 240,
        images: ImagePolicy | None = None,
    ) -> None:
        """Members in Kubernetes namespace `namespace`, from `image`, reaching etcd at
        `etcd` (as pods see it, e.g. `etcd:2379`).

        `api_client` None: the in-cluster configuration (the pod's service account),
        else the kubeconfig (KUBECONFIG or ~/.kube/config). `manifests`: the folder of
        the Job template (`job.yaml`), else $COORDINATOR_MANIFESTS, else the
        repository's `k8s/`. `grace_seconds`: the pods' grace from SIGTERM to SIGKILL
        (the service's `--grace`). `images`: those a `command` job may run in (default:
        only `image`). Bad values and a missing template raise here, so
        the service refuses to start instead of failing every job; nothing connects
        until the first job.
        """
        self.image, self.namespace = image, namespace
        self.images = images if images is not None else ImagePolicy.of(image)
        self.etcd = _pod_endpoints(etcd)
        self.grace_seconds = grace_seconds
        self.request_timeout = request_timeout
        self.watch_seconds = watch_seconds
        self._template = k8s.job_template(manifests)
        k8s.worker_job(1, "check", image, self.etcd, template=self._template)  # raises early
        self._own_client = api_client is None
        self.api_client = api_client if api_client is not None else _default_client()
        self._batch = k8s_client.BatchV1Api(self.api_client)
        self._core = k8s_client.CoreV1Api(self.api_client)
        self._lock = threading.Lock()
        self._pods: collections.OrderedDict[str, PodState] = collections.OrderedDict()
        self._created: set[str] = set()  # Jobs known to exist: `start` posts once each
        self._suspended: set[str] = set()
        self._deleted: set[str] = set()
        self._synced = threading.Event()  # the cache holds a full listing
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: Any = None  # the watch's open response, closed by `close`

    # -- the Job ----------------------------------------------------------------

    def job(self, launch: Launch) -> dict[str, Any]:
        """The Job of `launch`'s attempt, exactly as `start` sends it."""
        command = launch.command.with_etcd(self.etcd)
        args = ["worker", *command.argv()]
        spec = launch.spec
        # A `command` job's own image, if allowed (checked at submit; again here, as the
        # record came from etcd): ValueError naming it, before the API is asked anything.
        image = self.images.check(spec.image) if spec.kind == COMMAND else self.image
        body = k8s.worker_job(
            spec.workers,
            command.job_id,
            image,
            self.etcd,
            command.namespace or k8s.DEFAULT_NAMESPACE,
            command.kind or spec.kind,
            "",  # the job's parameters are in `args` (`--param`), which win over the env
            template=self._template,
            name=job_name(launch.run_id, launch.attempt),
            args=args,
            labels={
                LAUNCHER_LABEL: "kubernetes",
                RUN_LABEL: run_label(launch.run_id),
                ATTEMPT_LABEL: str(launch.attempt),
            },
            annotations={RUN_ANNOTATION: launch.run_id},
            grace_seconds=self.grace_seconds,
            credentials=launch.credentials is not None,
        )
        body["metadata"]["namespace"] = self.namespace
        pod = body["spec"]["template"]["spec"]
        (worker,) = (c for c in pod["containers"] if c["name"] == WORKER_CONTAINER)
        if spec.gpus_per_worker > 0:  # whole GPUs per pod, from the device plugin
            limits = worker.setdefault("resources", {}).setdefault("limits", {})
            limits[GPU_RESOURCE] = spec.gpus_per_worker
        if spec.kind == COMMAND:  # the program's variables and folder, inside the image
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

    def reserve(self, launch: Launch) -> Reservation:
        return NOTHING  # the cluster queues pods that do not fit (Pending) itself

    def start(self, launch: Launch, index: int) -> Member:
        """Ensure the attempt's Job exists (one POST per launcher and attempt); the
        member is its pod of completion index `index`."""
        if not 0 <= index < launch.spec.workers:
            raise ValueError(f"member {index} is not in 0..{launch.spec.workers - 1}")
        name = job_name(launch.run_id, launch.attempt)
        self._ensure_following()
        with self._lock:
            known = name in self._created
        if not known:
            created = self._create_job(name, self.job(launch))
            if launch.credentials is not None:
                self._create_credentials(launch, created)
            with self._lock:
                self._created.add(name)
        return Member(index=index, container=f"{self.namespace}/{name}/{index}")

    def _create_job(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST the Job; the Job as the API has it (read back if it existed: 409)."""
        what = f"Kubernetes Job {name} in namespace {self.namespace}"
        try:
            response = self._batch.create_namespaced_job(
                self.namespace,
                body,
                field_validation="Strict",  # an unknown field fails, not dropped
                # Said outright: this client version sends none for a create, which the
                # API server takes as JSON, but a proxy in between may not.
                _headers={"Content-Type": "application/json"},
                _preload_content=False,
                _request_timeout=self.request_timeout,
            )
            return dict(json.loads(response.data))
        except ApiException as exc:
            if exc.status != 409:  # 409 AlreadyExists: created before, by us or a peer
                raise RuntimeError(f"could not create {what}: {_api_message(exc)}") from None
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
            raise RuntimeError(f"could not create {what}: {self._no_answer(exc)}") from None
        try:  # its uid, for the Secret's owner reference
            response = self._batch.read_namespaced_job(
                name, self.namespace, _preload_content=False, _request_timeout=self.request_timeout
            )
            return dict(json.loads(response.data))
        except ApiException as exc:
            raise RuntimeError(f"could not read {what}: {_api_message(exc)}") from None
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
            raise RuntimeError(f"could not read {what}: {self._no_answer(exc)}") from None

    def _create_credentials(self, launch: Launch, job: dict[str, Any]) -> None:
        """The Secret of the job's etcd user, owned by `job`; replaced if it exists (an
        attempt started before, by us or a peer: the credentials stored for the job)."""
        assert launch.credentials is not None
        name = k8s.credentials_secret(job_name(launch.run_id, launch.attempt))
        body = k8s.credentials_secret_body(
            name,
            launch.credentials.user,
            launch.credentials.password,
            owner=job,
            labels={
                LAUNCHER_LABEL: "kubernetes",
                RUN_LABEL: run_label(launch.run_id),
                ATTEMPT_LABEL: str(launch.attempt),
            },
        )
        what = f"Kubernetes Secret {name} in namespace {self.namespace}"
        options: dict[str, Any] = {
            "field_validation": "Strict",
            "_headers": {"Content-Type": "application/json"},
            "_preload_content": False,
            "_request_timeout": self.request_timeout,
        }
        try:
            try:
                self._core.create_namespaced_secret(self.namespace, body, **options)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self._core.replace_namespaced_secret(name, self.namespace, body, **options)
        except ApiException as exc:  # (its message names the Secret, never its data)
            raise RuntimeError(f"could not create {what}: {_api_message(exc)}") from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise RuntimeError(f"could not create {what}: {self._no_answer(exc)}") from None

    def _no_answer(self, exc: Exception) -> str:
        return f"the API at {self.api_client.configuration.host} did not answer ({exc})"

    # -- following --------------------------------------------------------------

    def exit_code(self, member: Member) -> int | None:
        """The worker container's exit code once its pod ended; `VANISHED` for a pod
        deleted before it said, or none at all where its Job is gone or will make none."""
        namespace, job, index = self._where(member)
        self._ensure_following()
        if not self._synced.is_set():
            return None  # not listed yet: asked again next tick
        state = self._newest(job, index)
        if state is not None:
            if state.exit_code is not None:
                return state.exit_code
            return VANISHED if state.deleted else None
        try:  # no pod seen: not created yet, or never will be
            response = self._batch.read_namespaced_job(
                job, namespace, _preload_content=False, _request_timeout=self.request_timeout
            )
            found = json.loads(response.data)
        except ApiException as exc:
            if exc.status == 404:
                return VANISHED  # the Job is gone, and its pods with it
            log.warning("Job %s: %s", job, _api_message(exc))
            return None
        except FOLLOW_ERRORS as exc:
            log.warning("Job %s: %s", job, exc)
            return None
        return VANISHED if _makes_no_more_pods(found) else None

    def output(self, member: Member, offset: int) -> bytes:
        """The pod's log from byte `offset` on (read whole: the API has no offsets); b""
        before the pod runs, and once it is deleted (cluster logging keeps it then)."""
        namespace, job, index = self._where(member)
        self._ensure_following()
        state = self._newest(job, index)
        if state is None or state.deleted:
            return b""
        try:
            response = self._core.read_namespaced_pod_log(
                state.name,
                namespace,
                container=state.container,
                _preload_content=False,
                _request_timeout=self.request_timeout,
            )
            return bytes(response.data)[max(0, offset) :]
        except ApiException as exc:
            if exc.status not in (400, 404):  # 400: not started yet; 404: deleted meanwhile
                log.warning("pod %s log: %s", state.name, _api_message(exc))
            return b""
        except FOLLOW_ERRORS as exc:
            log.warning("pod %s log: %s", state.name, exc)
            return b""

    def terminate(self, member: Member) -> None:
        """Suspend the member's Job: the Job controller deletes its running pods with
        their grace (SIGTERM, then SIGKILL after `grace_seconds`), creates none in their
        place and counts none as failed.

        Not a pod deletion: the Job controller would count the deleted pod as failed
        (with `backoffLimit: 0`, failing the Job and deleting every other pod) or, with
        retries, start a replacement that joins a rendezvous the others have left. The
        API cannot signal a container, so the whole attempt stops: the reconciler only
        terminates members to stop their attempt, and asks for all of them.
        """
        namespace, job, _ = self._where(member)
        with self._lock:
            if job in self._suspended or job in self._deleted:
                return
        try:
            self._batch.patch_namespaced_job(
                job,
                namespace,
                {"spec": {"suspend": True}},
                _content_type="application/merge-patch+json",
                _preload_content=False,
                _request_timeout=self.request_timeout,
            )
        except ApiException as exc:
            if exc.status != 404:  # 404: gone already
                log.warning("Job %s: suspend: %s", job, _api_message(exc))
                return
        except FOLLOW_ERRORS as exc:
            log.warning("Job %s: suspend: %s", job, exc)
            return
        with self._lock:
            self._suspended.add(job)

    def kill(self, member: Member) -> None:
        """Delete the member's Job at once (`gracePeriodSeconds=0`) with Foreground
        propagation: its pods are deleted, then the Job, so `exit_code` keeps seeing the
        pods until they are really gone (Background would drop the Job first).

        Reached only after `terminate` and the grace: the pods have had their SIGTERM,
        and the Job, not a pod, is deleted for the reasons `terminate` gives. Deleting
        the Job also stops pods the suspension did not (a pod the Job controller had not
        yet reconciled). It needs no right to delete pods, which the Role does not grant.
        """
        namespace, job, _ = self._where(member)
        with self._lock:
            if job in self._deleted:
                return
        try:
            self._batch.delete_namespaced_job(
                job,
                namespace,
                grace_period_seconds=0,
                propagation_policy="Foreground",
                _preload_content=False,
                _request_timeout=self.request_timeout,
            )
        except ApiException as exc:
            if exc.status != 404:
                log.warning("Job %s: delete: %s", job, _api_message(exc))
                return
        except FOLLOW_ERRORS as exc:
            log.warning("Job %s: delete: %s", job, exc)
            return
        with self._lock:
            self._deleted.add(job)

    def remove(self, run_id: str) -> int:
        """Delete the Jobs of every attempt of `run_id` (their pods and logs go with
        them); how many. Errors are logged: `kubectl delete jobs -l
        etcd-coordinator/run=<run>` removes what is left."""
        removed = 0
        try:
            response = self._batch.list_namespaced_job(
                self.namespace,
                label_selector=f"{SELECTOR},{RUN_LABEL}={run_label(run_id)}",
                _preload_content=False,
                _request_timeout=self.request_timeout,
            )
            items = json.loads(response.data).get("items") or []
        except FOLLOW_ERRORS as exc:
            log.warning("Jobs of %s: list: %s", run_id, exc)
            return 0
        for item in items:
            metadata = item.get("metadata") or {}
            if (metadata.get("annotations") or {}).get(RUN_ANNOTATION, run_id) != run_id:
                continue  # another submission whose shortened label is the same
            name = metadata.get("name", "")
            try:
                self._batch.delete_namespaced_job(
                    name,
                    self.namespace,
                    propagation_policy="Background",
                    _preload_content=False,
                    _request_timeout=self.request_timeout,
                )
                removed += 1
            except ApiException as exc:
                if exc.status != 404:
                    log.warning("Job %s: delete: %s", name, _api_message(exc))
            except FOLLOW_ERRORS as exc:
                log.warning("Job %s: delete: %s", name, exc)
        names = {(item.get("metadata") or {}).get("name") for item in items}
        with self._lock:
            for key in [key for key, state in self._pods.items() if state.job in names]:
                del self._pods[key]
            self._created -= names
            self._suspended -= names
            self._deleted -= names
        return removed

    def close(self) -> None:
        """Stop following (the watch's connection is shut) and, if it was made here,
        close the API client."""
        self._stop.set()
        response = self._response
        if response is not None:
            _shutdown(response)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._own_client:
            self.api_client.close()

    # -- the pod cache ------------------------------------------------------------

    def pods(self) -> list[PodState]:
        """The cached pod states (live and remembered), for tests and debugging."""
        with self._lock:
            return list(self._pods.values())

    def _newest(self, job: str, index: int) -> PodState | None:
        """The member's pod: the newest of that Job and index (a replacement, if any)."""
        with self._lock:
            found = [s for s in self._pods.values() if s.job == job and s.index == index]
        return max(found, key=lambda s: (s.created, s.name), default=None)

    def _ensure_following(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(
                target=self._follow, name="kubernetes-pods", daemon=True
            )
        self._thread.start()

    def _follow(self) -> None:
        """List, then watch from the listing's resource version; list again whenever
        the watch fails or its version expired (410), with a growing pause on errors."""
        pause = 0.5
        while not self._stop.is_set():
            try:
                version = self._list()
                pause = 0.5
                while not self._stop.is_set():
                    version = self._watch(version)
            except _Expired:
                continue  # list again at once
            except Exception as exc:  # whatever it is, the thread must live: it is the cache
                if self._stop.is_set():
                    return
                expected = isinstance(exc, FOLLOW_ERRORS)
                log.warning("watching pods in %s: %s", self.namespace, exc, exc_info=not expected)
                self._stop.wait(pause)
                pause = min(pause * 2, 10.0)

    def _list(self) -> str:
        response = self._core.list_namespaced_pod(
            self.namespace,
            label_selector=SELECTOR,
            _preload_content=False,
            _request_timeout=self.request_timeout,
        )
        listing = json.loads(response.data)
        states = [s for s in map(pod_state, listing.get("items") or []) if s is not None]
        with self._lock:
            listed = {s.name for s in states}
            for name, old in list(self._pods.items()):
                if name not in listed and not old.deleted:  # deleted while we were away
                    self._remember(_replace(old, deleted=True))
            for state in states:
                self._pods[state.name] = state
            self._trim()
        self._synced.set()
        return str((listing.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        """One watch request (the server ends it after `watch_seconds`); the last
        resource version seen."""
        response = self._core.list_namespaced_pod(
            self.namespace,
            label_selector=SELECTOR,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_seconds,
            _preload_content=False,
            _request_timeout=(self.request_timeout, self.watch_seconds + self.request_timeout),
        )
        self._response = response
        try:
            for line in iter_resp_lines(response):
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Expired()
                    raise ValueError(f"watch error: {obj.get('message') or obj}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    state = pod_state(obj, deleted=kind == "DELETED")
                    if state is not None:
                        with self._lock:
                            self._remember(state)
                if self._stop.is_set():
                    break
        finally:
            self._response = None
            response.close()  # a watch left half-read must not go back to the pool
            response.release_conn()
        return version

    def _remember(self, state: PodState) -> None:
        """Keep `state` (a deleted pod keeps its last known exit code); lock held."""
        old = self._pods.pop(state.name, None)
        if state.deleted and state.exit_code is None and old is not None:
            state = _replace(old, deleted=True)
        self._pods[state.name] = state
        self._trim()

    def _trim(self) -> None:
        deleted = [name for name, s in self._pods.items() if s.deleted]
        for name in deleted[: max(0, len(deleted) - MAX_TOMBSTONES)]:
            del self._pods[name]

    def _where(self, member: Member) -> tuple[str, str, int]:
        """(namespace, Job, index) from what `start` recorded."""
        assert member.container is not None, "not a kubernetes member"
        namespace, job, index = member.container.split("/")
        return namespace, job, int(index)


class _Expired(Exception):
    """The watch's resource version is too old (410 Gone): list again."""


def _replace(state: PodState, **changes: Any) -> PodState:
    return PodState(**{**state.__dict__, **changes})


def _makes_no_more_pods(job: dict[str, Any]) -> bool:
    """A Job with no pod running that is finished, suspended or being deleted."""
    status = job.get("status") or {}
    if status.get("active") or status.get("terminating"):
        return False
    finished = any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    metadata, spec = job.get("metadata") or {}, job.get("spec") or {}
    return finished or bool(spec.get("suspend")) or bool(metadata.get("deletionTimestamp"))


def _shutdown(response: Any) -> None:
    """Unblock a thread reading `response` (a watch) by shutting its socket down."""
    try:
        sock = getattr(getattr(response, "connection", None), "sock", None)
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


#: Where a pod finds its own namespace (with its service account's token).
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def current_namespace(in_cluster_file: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    """The namespace to launch in when none is given: the pod's own, else the kubeconfig's
    current context's, else "default" (what kubectl would use)."""
    try:
        return in_cluster_file.read_text().strip() or "default"
    except OSError:
        pass
    try:
        _, context = k8s_config.list_kube_config_contexts(_kubeconfig())
        return str((context or {}).get("context", {}).get("namespace") or "default")
    except (k8s_config.ConfigException, OSError):
        return "default"


def _kubeconfig() -> str | None:
    """$KUBECONFIG as it is now (the client reads it once, when it is imported)."""
    return os.environ.get("KUBECONFIG") or None


def _default_client() -> k8s_client.ApiClient:
    """In a pod, its service account; elsewhere the kubeconfig."""
    configuration = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException:
        try:
            k8s_config.load_kube_config(_kubeconfig(), client_configuration=configuration)
        except (k8s_config.ConfigException, OSError) as exc:
            raise RuntimeError(
                "no Kubernetes API: not in a pod with a service account, and no usable "
                f"kubeconfig (KUBECONFIG or ~/.kube/config): {exc}"
            ) from None
    return k8s_client.ApiClient(configuration)
