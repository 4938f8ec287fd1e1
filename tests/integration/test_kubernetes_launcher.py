"""The kubernetes launcher against a recording stand-in for the API server.

No cluster is reachable here. A small HTTP server on 127.0.0.1 plays the parts of
the Kubernetes API the launcher uses (Jobs: create, get, list, patch, delete; pods:
list, watch, log; Secrets: create, replace) and records every request; a real
`kubernetes.client.ApiClient` talks to it. What is checked: the requests the
launcher sends (one Job per attempt, exactly as `coordinator k8s` renders it, and
the Secret of its credentials, valid against the Kubernetes OpenAPI schemas in
strict mode) and how it reads the answers (exit codes from pod states, logs,
vanished pods). What a real API server and kubelet then do is not tested.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest
from kubernetes import client as k8s_client

from coordinator.deploy import k8s
from coordinator.etcd.users import Credentials
from coordinator.launch import WorkerCommand
from coordinator.service.launchers import (
    VANISHED,
    Launch,
    kubernetes_api,
    kubernetes_job,
    kubernetes_pods,
)
from coordinator.service.launchers import kubernetes as kl
from coordinator.service.model import JobSpec, Member
from tests.support.wait import wait_until

NS = "team-a"
IMAGE = "registry.example/etcd-coordinator:0.1.0"
ETCD = "etcd:2379"
JOBS_PATH = f"/apis/batch/v1/namespaces/{NS}/jobs"
SECRETS_PATH = f"/api/v1/namespaces/{NS}/secrets"
CREDENTIALS = Credentials("/coordinator/jobs/demo", "s3cret-password-of-the-job-0123456789")
K8S_VERSIONS = sorted({"1.30", ".".join(kubernetes_validate.latest_version().split(".")[:2])})


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


@dataclass
class StandIn:
    """The API server's state as the stand-in keeps it: Jobs, pods, logs, events."""

    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    secrets: dict[str, dict[str, Any]] = field(default_factory=dict)
    refuse_secrets: bool = False  # Secrets answer 403 (a Role without the right)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    logs: dict[str, bytes] = field(default_factory=dict)
    events: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    version: int = 100
    broken: bool = False  # every request answers 500
    changed: threading.Condition = field(default_factory=threading.Condition)
    closing: bool = False

    def set_pod(self, pod: dict[str, Any]) -> None:
        with self.changed:
            self.version += 1
            pod["metadata"]["resourceVersion"] = str(self.version)
            kind = "MODIFIED" if pod["metadata"]["name"] in self.pods else "ADDED"
            self.pods[pod["metadata"]["name"]] = pod
            self.events.append((self.version, kind, json.loads(json.dumps(pod))))
            self.changed.notify_all()

    def delete_pod(self, name: str) -> None:
        with self.changed:
            self.version += 1
            pod = self.pods.pop(name)
            pod["metadata"]["resourceVersion"] = str(self.version)
            self.events.append((self.version, "DELETED", pod))
            self.changed.notify_all()

    def posts(self) -> list[Request]:
        return [r for r in self.requests if r.method == "POST" and r.path == JOBS_PATH]

    def secret_writes(self) -> list[Request]:
        return [r for r in self.requests if r.path.startswith(SECRETS_PATH)]


def matches(selector: str, labels: dict[str, str]) -> bool:
    pairs = [term.split("=", 1) for term in selector.split(",") if term]
    return all(labels.get(key) == value for key, value in pairs)


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": reason,
        "message": message,
        "code": code,
    }


class Handler(BaseHTTPRequestHandler):
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        state = self.server.state
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        state.requests.append(Request(self.command, url.path, query, dict(self.headers), body))
        if state.broken:
            return self._send(500, status(500, "InternalError", "the stand-in is broken"))
        parts = url.path.strip("/").split("/")
        if url.path.startswith(JOBS_PATH):
            return self._jobs(parts[6:], query, body)
        if url.path.startswith(f"/api/v1/namespaces/{NS}/pods"):
            return self._pods(parts[5:], query)
        if url.path.startswith(SECRETS_PATH):
            return self._secrets(parts[5:], body)
        return self._send(404, status(404, "NotFound", f"no {url.path}"))

    do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _handle

    def _jobs(self, rest: list[str], query: dict[str, list[str]], body: Any) -> None:
        state = self.server.state
        if not rest and self.command == "POST":
            name = body["metadata"]["name"]
            if name in state.jobs:
                return self._send(409, status(409, "AlreadyExists", f'jobs "{name}" exists'))
            body["metadata"]["uid"] = f"uid-{len(state.jobs)}-{name}"  # as the API sets it
            state.jobs[name] = body
            return self._send(201, body)
        if not rest and self.command == "GET":
            selector = query.get("labelSelector", [""])[0]
            items = [j for j in state.jobs.values() if matches(selector, j["metadata"]["labels"])]
            return self._send(200, {"kind": "JobList", "metadata": {}, "items": items})
        name = rest[0]
        if name not in state.jobs:
            return self._send(404, status(404, "NotFound", f'jobs "{name}" not found'))
        if self.command == "PATCH":
            state.jobs[name]["spec"].update(body["spec"])
        elif self.command == "DELETE":
            return self._send(200, state.jobs.pop(name))
        return self._send(200, state.jobs[name])

    def _secrets(self, rest: list[str], body: Any) -> None:
        state = self.server.state
        if state.refuse_secrets:
            return self._send(403, status(403, "Forbidden", "secrets is forbidden"))
        name = body["metadata"]["name"]
        if self.command == "POST" and not rest:
            if name in state.secrets:
                return self._send(409, status(409, "AlreadyExists", f'secrets "{name}" exists'))
            state.secrets[name] = body
            return self._send(201, body)
        if self.command == "PUT" and rest == [name] and name in state.secrets:
            state.secrets[name] = body
            return self._send(200, body)
        return self._send(404, status(404, "NotFound", f'secrets "{name}" not found'))

    def _pods(self, rest: list[str], query: dict[str, list[str]]) -> None:
        state = self.server.state
        if rest:  # <name>/log
            log = state.logs.get(rest[0])
            if log is None:
                return self._send(404, status(404, "NotFound", f'pods "{rest[0]}" not found'))
            return self._send(200, log, "text/plain")
        selector = query.get("labelSelector", [""])[0]
        if query.get("watch") != ["true"]:
            with state.changed:
                items = [
                    p for p in state.pods.values() if matches(selector, p["metadata"]["labels"])
                ]
                listing = {
                    "kind": "PodList",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(state.version)},
                    "items": items,
                }
            return self._send(200, listing)
        since = int(query["resourceVersion"][0])
        with state.changed:  # a short watch: what is new, or what comes within 0.3 s
            state.changed.wait_for(
                lambda: state.closing or any(rv > since for rv, _, _ in state.events), 0.3
            )
            events = [
                {"type": kind, "object": obj}
                for rv, kind, obj in state.events
                if rv > since and matches(selector, obj["metadata"]["labels"])
            ]
        data = b"".join(json.dumps(event).encode() + b"\n" for event in events)
        self._send(200, data)


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: StandIn) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.state = state


@pytest.fixture
def api() -> Iterator[tuple[StandIn, k8s_client.ApiClient]]:
    """The stand-in on loopback, and a real API client pointed at it."""
    state = StandIn()
    server = Server(state)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    configuration = k8s_client.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
    api_client = k8s_client.ApiClient(configuration)
    try:
        yield state, api_client
    finally:
        with state.changed:
            state.closing = True
            state.changed.notify_all()
        api_client.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def launchers(api: tuple[StandIn, k8s_client.ApiClient]) -> Iterator[list[kl.KubernetesLauncher]]:
    """Launchers made by the test (closed, their watch threads stopped, at the end)."""
    made: list[kl.KubernetesLauncher] = []
    try:
        yield made
    finally:
        for launcher in made:
            launcher.close()
            assert launcher.pod_cache._thread is None or not launcher.pod_cache._thread.is_alive()


def new_launcher(
    api: tuple[StandIn, k8s_client.ApiClient], made: list[kl.KubernetesLauncher]
) -> kl.KubernetesLauncher:
    launcher = kl.KubernetesLauncher(IMAGE, NS, ETCD, api[1], grace_seconds=7)
    made.append(launcher)
    return launcher


def launch(
    workers: int,
    run_id: str = "demo-1a2b3c4d",
    attempt: int = 1,
    credentials: Credentials | None = CREDENTIALS,
    gpus: int = 0,
) -> Launch:
    job_id = run_id.rsplit("-", 1)[0]
    command = WorkerCommand(
        job_id=job_id, world_size=workers, etcd="127.0.0.1:2379", namespace="/coordinator",
        kind="steps", ttl=10, params={"steps": "5"},
    )  # fmt: skip
    spec = JobSpec(
        id=job_id, kind="steps", workers=workers, launcher="kubernetes", gpus_per_worker=gpus
    )
    return Launch(
        run_id=run_id, attempt=attempt, spec=spec, command=command, credentials=credentials
    )


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port bound but not listening: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def pod_of(job: dict[str, Any], index: int, **status: Any) -> dict[str, Any]:
    """A pod as the Job controller makes it (labels, index annotation), with `status`."""
    name = job["metadata"]["name"]
    labels = {
        **job["spec"]["template"]["metadata"]["labels"],
        "batch.kubernetes.io/job-name": name,
        "job-name": name,
        "batch.kubernetes.io/job-completion-index": str(index),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-{index}-abcde",
            "namespace": NS,
            "labels": labels,
            "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "status": status,
    }


def running() -> dict[str, Any]:
    return {
        "phase": "Running",
        "containerStatuses": [{"name": "worker", "state": {"running": {}}}],
    }


def terminated(code: int) -> dict[str, Any]:
    return {
        "phase": "Failed" if code else "Succeeded",
        "containerStatuses": [
            {"name": "worker", "state": {"terminated": {"exitCode": code, "reason": "Error"}}}
        ],
    }


@pytest.mark.parametrize("workers", [4, 64])
def test_the_launcher_creates_exactly_one_job_with_n_completions(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher], workers: int
) -> None:
    state = api[0]
    launcher = new_launcher(api, launchers)
    attempt = launch(workers)
    members = [launcher.start(attempt, index) for index in range(workers)]

    posts = state.posts()
    assert len(posts) == 1, [(r.method, r.path) for r in state.requests]
    (post,) = posts
    assert post.headers["Content-Type"] == "application/json"
    assert post.query.get("fieldValidation") == ["Strict"]
    job = post.body
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)
    spec = job["spec"]
    assert spec["completions"] == spec["parallelism"] == workers
    assert spec["completionMode"] == "Indexed"
    assert spec["backoffLimit"] == 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == 7
    (worker,) = pod["containers"]
    assert worker["image"] == IMAGE
    # The image's entrypoint is `coordinator`; etcd as the pods reach it, not loopback.
    assert worker["args"][:1] == ["worker"]
    assert worker["args"][worker["args"].index("--etcd") + 1] == ETCD
    assert worker["args"][worker["args"].index("--world-size") + 1] == str(workers)
    assert "--param" in worker["args"]
    env = {var["name"]: var.get("value") for var in worker["env"]}
    assert env["COORDINATOR_ETCD"] == ETCD and env["COORDINATOR_WORLD_SIZE"] == str(workers)
    assert job["metadata"]["name"] == kubernetes_job.job_name("demo-1a2b3c4d", 1)
    assert job["metadata"]["namespace"] == NS
    # Its pods are the ones the launcher watches.
    pod_labels = job["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[kubernetes_job.LAUNCHER_LABEL] == "kubernetes"

    # Every member names that Job and its own index: each finds its pod again.
    assert [m.index for m in members] == list(range(workers))
    assert len({m.container for m in members}) == workers
    assert all(m.container == f"{NS}/{job['metadata']['name']}/{m.index}" for m in members)
    assert list(state.jobs) == [job["metadata"]["name"]]


def test_the_job_is_the_one_coordinator_k8s_renders(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    """One source: the launcher's Job is `worker_job`, the function `render` uses, with
    only what makes it this attempt's (name, labels, args, grace) added."""
    launcher = new_launcher(api, launchers)
    sent = launcher.job(launch(4))
    rendered = k8s.worker_job(k8s.WorkerPods(4, "demo", IMAGE, ETCD, kind="steps"))
    (job,) = [
        d
        for d in k8s.render(k8s.WorkerPods(4, "demo", IMAGE, ETCD, kind="steps"))
        if d["kind"] == "Job"
    ]
    assert job == rendered
    assert normalised(sent) == normalised(rendered)


def normalised(job: dict[str, Any]) -> dict[str, Any]:
    """`job` without what makes it one attempt's: name, labels, args, grace, and the name
    of its credentials Secret (the Job's name and a suffix)."""
    secret = k8s.credentials_secret(job["metadata"]["name"])
    assert f'"{secret}"' in json.dumps(job)
    job = json.loads(json.dumps(job).replace(f'"{secret}"', '"<credentials>"'))
    job["metadata"].pop("name")
    job["metadata"].pop("namespace", None)
    for meta in (job["metadata"], job["spec"]["template"]["metadata"]):
        meta.get("labels", {}).pop(kubernetes_job.LAUNCHER_LABEL, None)
        meta.get("labels", {}).pop(kubernetes_job.RUN_LABEL, None)
        meta.get("labels", {}).pop(kubernetes_job.ATTEMPT_LABEL, None)
        meta.pop("annotations", None)
    pod = job["spec"]["template"]["spec"]
    pod.pop("terminationGracePeriodSeconds")
    (worker,) = pod["containers"]
    worker.pop("args")
    return job


def test_a_second_launcher_finds_the_job_created_before(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    """A new leader finishing its predecessor's launch: 409 AlreadyExists is success."""
    state = api[0]
    first, second = new_launcher(api, launchers), new_launcher(api, launchers)
    a = first.start(launch(4), 0)
    b = second.start(launch(4), 1)
    assert [r.body["metadata"]["name"] for r in state.posts()] == [
        kubernetes_job.job_name("demo-1a2b3c4d", 1)
    ] * 2
    assert len(state.jobs) == 1
    assert a.container is not None and b.container is not None
    assert a.container.rsplit("/", 1)[0] == b.container.rsplit("/", 1)[0]


def test_each_attempt_gets_a_job_of_its_own(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    state = api[0]
    launcher = new_launcher(api, launchers)
    launcher.start(launch(2, attempt=1), 0)
    launcher.start(launch(2, attempt=2), 0)
    assert len(state.posts()) == 2
    assert len(set(state.jobs)) == 2


def test_exit_codes_come_from_the_pods_terminated_state(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    state = api[0]
    launcher = new_launcher(api, launchers)
    attempt = launch(3)
    members = [launcher.start(attempt, index) for index in range(3)]
    job = state.posts()[0].body
    state.set_pod(pod_of(job, 0, **terminated(3)))
    state.set_pod(pod_of(job, 1, **running()))
    state.set_pod(pod_of(job, 2, phase="Pending"))

    wait_until(lambda: len(launcher.pods()) == 3, 10, "the three pods in the cache")
    assert launcher.exit_code(members[0]) == 3
    # Known and running (not merely unknown): the cache holds the pod, and it runs.
    pods = {p.index: p for p in launcher.pods()}
    assert pods[1].exit_code is None and not pods[1].deleted
    assert launcher.exit_code(members[1]) is None
    assert launcher.exit_code(members[2]) is None

    state.set_pod(pod_of(job, 1, **terminated(0)))  # through the watch
    assert wait_until(lambda: launcher.exit_code(members[1]) == 0, 10, "exit code 0")
    state.delete_pod(pod_of(job, 2)["metadata"]["name"])  # deleted before it ran
    assert wait_until(lambda: launcher.exit_code(members[2]) == VANISHED, 10, "vanished")
    # A terminated pod deleted afterwards keeps its exit code.
    state.delete_pod(pod_of(job, 0)["metadata"]["name"])
    wait_until(lambda: all(p.deleted for p in launcher.pods() if p.index == 0), 10, "deleted")
    assert launcher.exit_code(members[0]) == 3


def test_a_member_of_a_job_that_no_longer_exists_vanished(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    state = api[0]
    launcher = new_launcher(api, launchers)
    member = launcher.start(launch(2), 0)
    # The Job exists and has no pod yet: not ended.
    wait_until(lambda: launcher.pod_cache.synced.is_set(), 10, "the first pod listing")
    assert launcher.exit_code(member) is None
    state.jobs.clear()  # deleted by someone, with its pods
    assert launcher.exit_code(member) == VANISHED
    gone = Member(index=0, container=f"{NS}/coordinator-never-created/0")
    assert launcher.exit_code(gone) == VANISHED


def test_a_suspended_job_without_pods_ends_its_members(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    state = api[0]
    launcher = new_launcher(api, launchers)
    member = launcher.start(launch(2), 1)
    wait_until(lambda: launcher.pod_cache.synced.is_set(), 10, "the first pod listing")
    launcher.terminate(member)
    (name,) = state.jobs
    state.jobs[name]["status"] = {"active": 1}
    assert launcher.exit_code(member) is None  # a pod still runs somewhere
    state.jobs[name]["status"] = {}
    assert launcher.exit_code(member) == VANISHED


def test_terminate_suspends_the_job_once_and_kill_deletes_it_at_once(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    state = api[0]
    launcher = new_launcher(api, launchers)
    members = [launcher.start(launch(4), index) for index in range(4)]
    (name,) = state.jobs
    for member in members:
        launcher.terminate(member)
    patches = [r for r in state.requests if r.method == "PATCH"]
    assert len(patches) == 1
    assert patches[0].path == f"{JOBS_PATH}/{name}"
    assert patches[0].headers["Content-Type"] == "application/merge-patch+json"
    assert patches[0].body == {"spec": {"suspend": True}}
    assert state.jobs[name]["spec"]["suspend"] is True

    for member in members:
        launcher.kill(member)
    deletes = [r for r in state.requests if r.method == "DELETE"]
    assert len(deletes) == 1
    assert deletes[0].path == f"{JOBS_PATH}/{name}"
    assert deletes[0].query["gracePeriodSeconds"] == ["0"]
    assert deletes[0].query["propagationPolicy"] == ["Foreground"]
    assert not state.jobs
    # No pod was deleted directly: the Role grants no such right.
    assert not [r for r in state.requests if r.method == "DELETE" and "/pods" in r.path]


def test_output_is_the_pod_log_from_an_offset(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    state = api[0]
    launcher = new_launcher(api, launchers)
    member = launcher.start(launch(2), 1)
    assert launcher.output(member, 0) == b""  # no pod yet
    pod = pod_of(state.posts()[0].body, 1, **running())
    state.logs[pod["metadata"]["name"]] = b'{"event": "joined"}\n{"event": "done"}\n'
    state.set_pod(pod)
    assert wait_until(lambda: launcher.output(member, 0), 10, "the log")
    assert launcher.output(member, 0) == b'{"event": "joined"}\n{"event": "done"}\n'
    assert launcher.output(member, 20) == b'{"event": "done"}\n'
    assert launcher.output(member, 1000) == b""
    (log_request, *_) = [r for r in state.requests if r.path.endswith("/log")]
    assert log_request.query["container"] == ["worker"]


def test_a_failed_init_container_gives_its_exit_code_and_its_log(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    """etcd never reachable: the wait-for-etcd init container fails, the worker never ran."""
    state = api[0]
    launcher = new_launcher(api, launchers)
    member = launcher.start(launch(2), 0)
    pod = pod_of(
        state.posts()[0].body,
        0,
        phase="Failed",
        initContainerStatuses=[{"name": "wait-for-etcd", "state": {"terminated": {"exitCode": 1}}}],
        containerStatuses=[{"name": "worker", "state": {"waiting": {"reason": "PodInitializing"}}}],
    )
    state.logs[pod["metadata"]["name"]] = b"etcd at ['etcd:2379'] not reachable within 600 s\n"
    state.set_pod(pod)
    assert wait_until(lambda: launcher.exit_code(member) == 1, 10, "exit code 1")
    assert b"not reachable" in launcher.output(member, 0)
    log_request = [r for r in state.requests if r.path.endswith("/log")][-1]
    assert log_request.query["container"] == ["wait-for-etcd"]


def test_api_errors_never_escape_while_following_and_start_names_them(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    state = api[0]
    launcher = new_launcher(api, launchers)
    member = launcher.start(launch(2), 0)
    wait_until(lambda: launcher.pod_cache.synced.is_set(), 10, "the first pod listing")
    state.broken = True
    before = len(state.requests)
    assert launcher.exit_code(member) is None  # the Job's GET answered 500
    assert launcher.output(member, 0) == b""
    launcher.terminate(member)
    launcher.kill(member)
    assert {r.method for r in state.requests[before:]} >= {"GET", "PATCH", "DELETE"}
    with pytest.raises(RuntimeError, match=r"could not create Kubernetes Job .* in namespace "):
        launcher.start(launch(2, run_id="other-00000000"), 0)
    with pytest.raises(RuntimeError, match="HTTP 500: the stand-in is broken"):
        launcher.start(launch(2, run_id="other-00000000"), 0)


def test_start_without_an_api_server_raises_naming_it() -> None:
    configuration = k8s_client.Configuration()
    with refused_port() as port:
        configuration.host = f"http://127.0.0.1:{port}"
        configuration.retries = 0
        api_client = k8s_client.ApiClient(configuration)
        launcher = kl.KubernetesLauncher(IMAGE, NS, ETCD, api_client)
        try:
            with pytest.raises(RuntimeError, match=f"API at http://127.0.0.1:{port} did not"):
                launcher.start(launch(2), 0)
            member = Member(index=0, container=f"{NS}/coordinator-x/0")
            assert launcher.output(member, 0) == b""
            launcher.terminate(member)
            launcher.kill(member)
        finally:
            launcher.close()
            api_client.close()


def test_remove_deletes_every_attempt_of_the_submission_only(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    state = api[0]
    launcher = new_launcher(api, launchers)
    launcher.start(launch(2, attempt=1), 0)
    launcher.start(launch(2, attempt=2), 0)
    launcher.start(launch(2, run_id="other-00000000"), 0)
    assert launcher.remove("demo-1a2b3c4d") == 2
    assert list(state.jobs) == [kubernetes_job.job_name("other-00000000", 1)]
    deletes = [r for r in state.requests if r.method == "DELETE"]
    assert all(r.query["propagationPolicy"] == ["Background"] for r in deletes)
    assert launcher.remove("demo-1a2b3c4d") == 0


def test_names_and_labels_fit_kubernetes_limits() -> None:
    long_run = "j" * 63 + "-1a2b3c4d"
    names = {
        kubernetes_job.job_name(run, attempt) for run in ("a-1", long_run) for attempt in (1, 2, 10)
    }
    assert len(names) == 6
    for name in names:
        assert len(f"{name}-{k8s.MAX_WORKERS - 1}") <= 63  # the pods' hostnames
    assert kubernetes_job.run_label("demo-1a2b3c4d") == "demo-1a2b3c4d"
    label = kubernetes_job.run_label(long_run)
    assert len(label) <= 63 and label != kubernetes_job.run_label("j" * 63 + "-1a2b3c4e")


def test_bad_settings_are_refused_when_the_launcher_is_made(
    api: tuple[StandIn, k8s_client.ApiClient], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="loopback, which pods cannot reach"):
        kl.KubernetesLauncher(IMAGE, NS, "127.0.0.1:2379", api[1])
    with pytest.raises(ValueError, match="image 'bad image'"):
        kl.KubernetesLauncher("bad image", NS, ETCD, api[1])
    with pytest.raises(FileNotFoundError, match="Job template not found"):
        kl.KubernetesLauncher(IMAGE, NS, ETCD, api[1], manifests=tmp_path)


def test_the_template_folder_comes_from_the_environment(
    api: tuple[StandIn, k8s_client.ApiClient],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In the image there is no k8s/: the Deployment mounts job.yaml from a ConfigMap."""
    text = (k8s.MANIFEST_DIR / k8s.WORKERS_FILE).read_text()
    (tmp_path / k8s.WORKERS_FILE).write_text(text.replace("memory: 1Gi", "memory: 3Gi"))
    monkeypatch.setenv(k8s.MANIFESTS_ENV, str(tmp_path))
    launcher = kl.KubernetesLauncher(IMAGE, NS, ETCD, api[1])
    try:
        (worker,) = launcher.job(launch(2))["spec"]["template"]["spec"]["containers"]
        assert worker["resources"]["limits"]["memory"] == "3Gi"
    finally:
        launcher.close()


def test_a_job_asking_gpus_gets_whole_gpus_in_each_pods_limits(
    api: tuple[StandIn, k8s_client.ApiClient],
) -> None:
    launcher = kl.KubernetesLauncher(IMAGE, NS, ETCD, api[1])
    try:
        job = launcher.job(launch(2, gpus=2))
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(job, version, strict=True)
        (worker,) = job["spec"]["template"]["spec"]["containers"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert worker["resources"]["limits"]["memory"] == "1Gi"  # the template's stay
        (plain,) = launcher.job(launch(2))["spec"]["template"]["spec"]["containers"]
        assert "nvidia.com/gpu" not in plain["resources"]["limits"]
    finally:
        launcher.close()


def test_pod_states_of_evicted_and_foreign_pods() -> None:
    job = {"metadata": {"name": "j"}, "spec": {"template": {"metadata": {"labels": {}}}}}
    evicted = kubernetes_pods.pod_state(pod_of(job, 2, phase="Failed", reason="Evicted"))
    assert evicted is not None and (evicted.index, evicted.exit_code) == (2, VANISHED)
    assert (
        kubernetes_pods.pod_state({"metadata": {"name": "p", "labels": {}}, "status": {}}) is None
    )


def test_the_default_namespace_is_the_pods_own_else_the_kubeconfigs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = tmp_path / "namespace"
    own.write_text("team-b\n")
    assert kubernetes_api.current_namespace(own) == "team-b"
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "contexts: [{name: c, context: {cluster: k, user: u, namespace: team-c}}]\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {}}]\n"
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert kubernetes_api.current_namespace(tmp_path / "absent") == "team-c"
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    assert kubernetes_api.current_namespace(tmp_path / "absent") == "default"


def test_without_a_client_the_kubeconfig_is_used_else_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(RuntimeError, match="no Kubernetes API: not in a pod"):
        kl.KubernetesLauncher(IMAGE, NS, ETCD)
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    launcher = kl.KubernetesLauncher(IMAGE, NS, ETCD)  # nothing connects yet
    try:
        assert launcher.api_client.configuration.host == "http://127.0.0.1:9"
    finally:
        launcher.close()


# -- the job's etcd credentials: a Secret the Job owns ------------------------------------


def secret_of(job: dict[str, Any]) -> str:
    return k8s.credentials_secret(job["metadata"]["name"])


def test_each_job_gets_its_etcd_credentials_in_a_secret_the_job_owns(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    """One Secret per Job (not per member), valid in strict mode, owned by the Job (its
    uid as the API gave it), holding the job's user and password; the pods take the user
    from it and mount the password as a file; the password is nowhere in the Job."""
    state = api[0]
    launcher = new_launcher(api, launchers)
    for index in range(4):
        launcher.start(launch(4), index)
    (post,) = state.posts()
    (write,) = state.secret_writes()
    job, secret = state.jobs[post.body["metadata"]["name"]], write.body
    assert (write.method, write.query.get("fieldValidation")) == ("POST", ["Strict"])
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(secret, version, strict=True)
    assert secret["metadata"]["name"] == secret_of(job)
    (owner,) = secret["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": job["metadata"]["name"],
        "uid": job["metadata"]["uid"],
        "blockOwnerDeletion": False,
    }
    data = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    assert data == {"user": CREDENTIALS.user, "password": CREDENTIALS.password}
    assert secret["metadata"]["labels"][kubernetes_job.RUN_LABEL] == "demo-1a2b3c4d"
    assert CREDENTIALS.password not in json.dumps(post.body)

    pod = job["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[k8s.CREDENTIALS_VOLUME]["secret"]["secretName"] == secret_of(job)
    (worker,) = pod["containers"]
    env = {var["name"]: var for var in worker["env"]}
    reference = env[k8s.USER_ENV]["valueFrom"]["secretKeyRef"]
    assert reference == {"name": secret_of(job), "key": "user"}
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    folder = mounts[k8s.CREDENTIALS_VOLUME]
    assert env[k8s.PASSWORD_FILE_ENV]["value"] == f"{folder}/password"
    assert env["COORDINATOR_ETCD_CA"]["value"].startswith(mounts["etcd-ca"] + "/")


def test_a_second_launcher_replaces_the_secret_of_the_job_it_finds(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    """A new leader finishing a launch: the Job exists (409), so it reads the Job's uid
    and replaces the Secret (409 on create) with the credentials it was given."""
    state = api[0]
    first, second = new_launcher(api, launchers), new_launcher(api, launchers)
    first.start(launch(2), 0)
    newer = Credentials(CREDENTIALS.user, "another-password-of-the-same-job-987654")
    second.start(launch(2, credentials=newer), 1)
    assert [(r.method, r.path.rsplit("/", 1)[-1]) for r in state.secret_writes()] == [
        ("POST", "secrets"),
        ("POST", "secrets"),
        ("PUT", secret_of(next(iter(state.jobs.values())))),
    ]
    (job,) = state.jobs.values()
    (secret,) = state.secrets.values()
    assert base64.b64decode(secret["data"]["password"]).decode() == newer.password
    assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]


def test_without_credentials_the_job_has_no_secret_and_no_user(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    """An etcd without auth: no Secret is made, and the pods neither mount one (kubelet
    would wait for it for ever) nor name a user."""
    state = api[0]
    launcher = new_launcher(api, launchers)
    launcher.start(launch(2, credentials=None), 0)
    assert state.secret_writes() == []
    (job,) = state.jobs.values()
    pod = job["spec"]["template"]["spec"]
    assert k8s.CREDENTIALS_VOLUME not in {v["name"] for v in pod["volumes"]}
    for container in [*pod["initContainers"], *pod["containers"]]:
        names = {var["name"] for var in container.get("env", [])}
        assert not names & {k8s.USER_ENV, k8s.PASSWORD_FILE_ENV}, container["name"]
        assert k8s.CREDENTIALS_VOLUME not in {m["name"] for m in container["volumeMounts"]}
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)


def test_a_refused_secret_fails_the_start_naming_it_never_the_password(
    api: tuple[StandIn, k8s_client.ApiClient], launchers: list[kl.KubernetesLauncher]
) -> None:
    state = api[0]
    state.refuse_secrets = True
    launcher = new_launcher(api, launchers)
    with pytest.raises(RuntimeError, match="could not create Kubernetes Secret") as failed:
        launcher.start(launch(2), 0)
    assert "secrets is forbidden" in str(failed.value)
    assert CREDENTIALS.password not in str(failed.value)
    state.refuse_secrets = False  # the next tick tries again: Job found, Secret made
    launcher.start(launch(2), 0)
    assert len(state.secrets) == 1


def test_a_command_job_runs_its_program_in_an_allowed_image_with_its_env_and_folder(
    api: tuple[StandIn, k8s_client.ApiClient],
) -> None:
    from coordinator.service.images import ImagePolicy

    launcher = kl.KubernetesLauncher(
        IMAGE, NS, ETCD, api[1], images=ImagePolicy.of(IMAGE, ["trainers/*"])
    )
    try:
        plain = launch(2)
        command = plain.command.model_copy(
            update={"kind": "command", "params": {}, "program": ("python", "train.py", "--lr=1")}
        )
        spec = JobSpec(
            id=plain.spec.id, kind="command", workers=2, launcher="kubernetes",
            command=["python", "train.py", "--lr=1"], image="trainers/ddp:3",
            env={"WANDB_MODE": "offline"}, working_dir="/srv/train",
        )  # fmt: skip
        job = launcher.job(Launch(plain.run_id, 1, spec, command, CREDENTIALS))
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(job, version, strict=True)
        pod = job["spec"]["template"]["spec"]
        (worker,) = pod["containers"]
        assert {c["image"] for c in [*pod.get("initContainers", []), worker]} == {"trainers/ddp:3"}
        assert worker["args"][-4:] == ["--", "python", "train.py", "--lr=1"]
        assert {"name": "WANDB_MODE", "value": "offline"} in worker["env"]
        assert worker["workingDir"] == "/srv/train"
        # A record naming an image the service does not allow (forged, or the list changed
        # since) starts nothing: refused before the API is asked.
        forged = spec.model_copy(update={"image": "evil/miner:1"})
        with pytest.raises(ValueError, match="evil/miner:1"):
            launcher.job(Launch(plain.run_id, 1, forged, command, CREDENTIALS))
        # Other kinds keep the service's image and take none of these.
        (other,) = launcher.job(plain)["spec"]["template"]["spec"]["containers"]
        assert other["image"] == IMAGE and "workingDir" not in other
    finally:
        launcher.close()
