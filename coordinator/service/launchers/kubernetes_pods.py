"""The pods a kubernetes launcher created, as it follows them: each pod's state (a pure
mapping from the pod's JSON) and the cache one list-then-watch keeps on a thread.

The cache follows the pods labelled `etcd-coordinator/launcher=kubernetes`: a member's
exit code is its container's terminated state, and a deleted pod is remembered (its
DELETED event carries its last state) until its submission is removed.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from coordinator.service.launchers import VANISHED
from coordinator.service.launchers.kubernetes_job import SELECTOR, WORKER_CONTAINER

log = logging.getLogger(__name__)

#: Where Kubernetes writes an Indexed Job pod's index and Job (labels since 1.27/1.28;
#: the annotation and the old `job-name` label before).
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
JOB_NAME_KEYS = ("batch.kubernetes.io/job-name", "job-name")
#: Deleted pods remembered for their exit codes (a pod's DELETED event carries its
#: last state) until their submission is removed; the oldest go first beyond this.
MAX_TOMBSTONES = 10_000
FOLLOW_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError)


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


def makes_no_more_pods(job: dict[str, Any]) -> bool:
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


class PodCache:
    def __init__(
        self,
        core: k8s_client.CoreV1Api,
        namespace: str,
        request_timeout: float,
        watch_seconds: int,
    ) -> None:
        """The launcher's pods in `namespace`, followed from the first `ensure_following`
        until `close`; each watch request lasts `watch_seconds`."""
        self._core, self.namespace = core, namespace
        self.request_timeout = request_timeout
        self.watch_seconds = watch_seconds
        self._lock = threading.Lock()
        self._pods: collections.OrderedDict[str, PodState] = collections.OrderedDict()
        self.synced = threading.Event()  # the cache holds a full listing
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: Any = None  # the watch's open response, closed by `close`

    def pods(self) -> list[PodState]:
        """The cached pod states (live and remembered), for tests and debugging."""
        with self._lock:
            return list(self._pods.values())

    def newest(self, job: str, index: int) -> PodState | None:
        """The member's pod: the newest of that Job and index (a replacement, if any)."""
        with self._lock:
            found = [s for s in self._pods.values() if s.job == job and s.index == index]
        return max(found, key=lambda s: (s.created, s.name), default=None)

    def forget(self, jobs: set[str]) -> None:
        """Drop the pods of these Jobs, live and remembered (their submission is removed)."""
        with self._lock:
            for key in [key for key, state in self._pods.items() if state.job in jobs]:
                del self._pods[key]

    def ensure_following(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(
                target=self._follow, name="kubernetes-pods", daemon=True
            )
        self._thread.start()

    def close(self) -> None:
        """Stop following: the watch's connection is shut and its thread joined."""
        self._stop.set()
        response = self._response
        if response is not None:
            _shutdown(response)
        if self._thread is not None:
            self._thread.join(timeout=10)

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
        self.synced.set()
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


class _Expired(Exception):
    """The watch's resource version is too old (410 Gone): list again."""


def _replace(state: PodState, **changes: Any) -> PodState:
    return PodState(**{**state.__dict__, **changes})


def _shutdown(response: Any) -> None:
    """Unblock a thread reading `response` (a watch) by shutting its socket down."""
    try:
        sock = getattr(getattr(response, "connection", None), "sock", None)
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
