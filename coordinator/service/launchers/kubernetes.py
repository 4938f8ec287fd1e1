"""Members as the pods of an Indexed Job, through the official `kubernetes` client.

Each attempt of a job is ONE Indexed Job (`completions = parallelism = N`,
`backoffLimit: 0`, `restartPolicy: Never`), built in `kubernetes_job` by the same
function that renders `coordinator k8s` manifests. Kubernetes numbers its pods
0..N-1: member `index` is the pod with that completion index. `start` creates the
Job on the first index it is asked for (409 AlreadyExists: another replica or a
predecessor created it, which is as good) and returns
`Member(container="<namespace>/<job name>/<index>")`, which finds the pod again from
any replica. The pods run `coordinator worker <command.argv()>` (the image's
entrypoint is `coordinator`), with the etcd endpoints replaced by those the pods
reach (`etcd`, e.g. `etcd:2379`). A `command` job's pods run its own image (one the
service allows: `serve --allowed-image`), its `env` in the worker container's
environment and its `working_dir` as the container's folder.

The job's etcd user (`Launch.credentials`) reaches its pods through a Secret
`<job name>-etcd` (keys `user`, `password`) that `start` creates right after the Job,
with the Job as its owner, so Kubernetes deletes it with the Job; the pods mount it
(kubelet waits for it to exist). The password is never in the Job, argv or a log.

The pods' states come from one watch on the pods this launcher created (label
`etcd-coordinator/launcher=kubernetes`), kept in memory by a thread
(`kubernetes_pods`): a member's exit code is its container's terminated state.
`output` reads the pod's log (the API has no byte offsets: it is read whole and
sliced).

Kubernetes errors while following never escape `exit_code`, `output`, `terminate`
or `kill`: they are logged, and the reconciler asks again on its next tick. `start`
raises with a message naming the Job, the namespace and the API's answer.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException

from coordinator.deploy import k8s
from coordinator.service.images import ImagePolicy
from coordinator.service.launchers import (
    NOTHING,
    OUTPUT_CAP,
    VANISHED,
    Launch,
    OnDemandLauncher,
    Reservation,
)
from coordinator.service.launchers.kubernetes_api import default_client
from coordinator.service.launchers.kubernetes_job import (
    RUN_ANNOTATION,
    RUN_LABEL,
    SELECTOR,
    attempt_job,
    credentials_secret,
    job_name,
    pod_endpoints,
    run_label,
)
from coordinator.service.launchers.kubernetes_pods import (
    FOLLOW_ERRORS,
    PodCache,
    PodState,
    makes_no_more_pods,
)
from coordinator.service.model import Member

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"


def _api_message(exc: ApiException) -> str:
    """The API server's own words (its Status `message`), else the HTTP reason."""
    try:
        body = json.loads(exc.body or "")
        if isinstance(body, dict) and body.get("message"):
            return f"HTTP {exc.status}: {body['message']}"
    except (TypeError, ValueError):
        pass
    return f"HTTP {exc.status}: {exc.reason}"


class KubernetesLauncher(OnDemandLauncher):
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
        else the kubeconfig (KUBECONFIG or ~/.kube/config; see `kubernetes_api`).
        `manifests`: the folder of the Job template (`job.yaml`), else
        $COORDINATOR_MANIFESTS, else the repository's `k8s/`. `grace_seconds`: the
        pods' grace from SIGTERM to SIGKILL (the service's `--grace`). `images`: those
        a `command` job may run in (default: only `image`). Bad values and a missing
        template raise here, so the service refuses to start instead of failing every
        job; nothing connects until the first job.
        """
        self.image, self.namespace = image, namespace
        self.images = images if images is not None else ImagePolicy.of(image)
        self.etcd = pod_endpoints(etcd)
        self.grace_seconds = grace_seconds
        self.request_timeout = request_timeout
        self._template = k8s.job_template(manifests)
        k8s.worker_job(k8s.WorkerPods(1, "check", image, self.etcd), template=self._template)
        self._own_client = api_client is None
        self.api_client = api_client if api_client is not None else default_client()
        self._batch = k8s_client.BatchV1Api(self.api_client)
        self._core = k8s_client.CoreV1Api(self.api_client)
        self.pod_cache = PodCache(self._core, namespace, request_timeout, watch_seconds)
        self._lock = threading.Lock()
        self._created: set[str] = set()  # Jobs known to exist: `start` posts once each
        self._suspended: set[str] = set()
        self._deleted: set[str] = set()

    # -- the Job ----------------------------------------------------------------

    def job(self, launch: Launch) -> dict[str, Any]:
        """The Job of `launch`'s attempt, exactly as `start` sends it."""
        return attempt_job(
            launch, self.image, self.images, self.etcd, self.namespace, self._template,
            self.grace_seconds,
        )  # fmt: skip

    def reserve(self, launch: Launch) -> Reservation:
        return NOTHING  # the cluster queues pods that do not fit (Pending) itself

    def start(self, launch: Launch, index: int) -> Member:
        """Ensure the attempt's Job exists (one POST per launcher and attempt); the
        member is its pod of completion index `index`."""
        if not 0 <= index < launch.spec.workers:
            raise ValueError(f"member {index} is not in 0..{launch.spec.workers - 1}")
        name = job_name(launch.run_id, launch.attempt)
        self.pod_cache.ensure_following()
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
        name, body = credentials_secret(launch, job)
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
        self.pod_cache.ensure_following()
        if not self.pod_cache.synced.is_set():
            return None  # not listed yet: asked again next tick
        state = self.pod_cache.newest(job, index)
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
        return VANISHED if makes_no_more_pods(found) else None

    def output(self, member: Member, offset: int) -> bytes:
        """The pod's log from byte `offset` on (read whole: the API has no offsets); b""
        before the pod runs, and once it is deleted (cluster logging keeps it then)."""
        namespace, job, index = self._where(member)
        self.pod_cache.ensure_following()
        state = self.pod_cache.newest(job, index)
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
            return bytes(response.data)[max(0, offset) : max(0, offset) + OUTPUT_CAP]
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
        suspend = {"body": {"spec": {"suspend": True}}, "_content_type": MERGE_PATCH}
        if self._ask("suspend", self._batch.patch_namespaced_job, job, namespace, **suspend):
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
        at_once = {"grace_period_seconds": 0, "propagation_policy": "Foreground"}
        if self._ask("delete", self._batch.delete_namespaced_job, job, namespace, **at_once):
            with self._lock:
                self._deleted.add(job)

    def _ask(
        self, what: str, request: Callable[..., object], job: str, namespace: str, **options: Any
    ) -> bool:
        """Make `request` (`what`) of Job `job`: whether it was done, or need not be (404:
        the Job is gone already). Errors are logged, never raised: asked again next tick."""
        try:
            request(
                job,
                namespace,
                **options,
                _preload_content=False,
                _request_timeout=self.request_timeout,
            )
        except ApiException as exc:
            if exc.status != 404:
                log.warning("Job %s: %s: %s", job, what, _api_message(exc))
                return False
        except FOLLOW_ERRORS as exc:
            log.warning("Job %s: %s: %s", job, what, exc)
            return False
        return True

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
        self.pod_cache.forget(names)
        with self._lock:
            self._created -= names
            self._suspended -= names
            self._deleted -= names
        return removed

    def close(self) -> None:
        """Stop following (the watch's connection is shut) and, if it was made here,
        close the API client."""
        self.pod_cache.close()
        if self._own_client:
            self.api_client.close()

    def pods(self) -> list[PodState]:
        """The cached pod states (live and remembered), for tests and debugging."""
        return self.pod_cache.pods()

    def _where(self, member: Member) -> tuple[str, str, int]:
        """(namespace, Job, index) from what `start` recorded."""
        assert member.container is not None, "not a kubernetes member"
        namespace, job, index = member.container.split("/")
        return namespace, job, int(index)
