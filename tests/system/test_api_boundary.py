"""The REST API's trust boundary, against a real `coordinator serve` on loopback.

Who asks is decided from the headers before the body is read; bodies are capped;
NaN and paths outside the operator's roots are refused naming the field; the
simulator runs apart, bounded, so the other endpoints keep answering and SIGTERM
still stops the service; auth is on unless --insecure, with a private token file
the CLI and the dashboard link find by themselves.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from coordinator.jobs.params import parse_param_list, parse_params
from tests.support.processes import unreachable_etcd
from tests.support.service import SUBMIT_TOKEN, ServiceProc, simulation_processes, wait_state
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd
MiB = 1024 * 1024
# The most a simulate request may cost (pbsp re-checks every waiting worker: the slowest
# method), just under the service's step budget.
# Just under the bound (2,000,000 steps): some 10 s of pBSP here.
WORST_SIMULATION = {"barrier": "pbsp:10", "workers": 10000, "seconds": 799, "delay": "exp:1,3"}
LATENCY_BOUND = 1.0  # seconds: what the brief allows each other endpoint under that load


def unauthenticated(service: ServiceProc) -> httpx.Client:
    return httpx.Client(base_url=service.url, timeout=30)


def raw_answer(service: ServiceProc, head: bytes, timeout: float = 5.0) -> bytes:
    """Send only `head` (the request line and headers, no body) and read the answer."""
    with socket.create_connection(("127.0.0.1", service.port), timeout=timeout) as sock:
        sock.sendall(head)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
        return answer


def detail_locations(response: httpx.Response) -> list[list[Any]]:
    assert response.status_code == 422, response.text
    return [item["loc"] for item in response.json()["detail"]]


# -- who asks, before the body --------------------------------------------------------------


def test_unauthenticated_bodies_of_any_size_and_content_get_401(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()
    with unauthenticated(service) as http:
        small = http.post("/v1/jobs", json={"kind": "noop", "workers": 1})
        bad_json = http.post("/v1/jobs", content=b"{not json", headers={"content-type": "x"})
        large = http.post("/v1/jobs", content=b"x" * (10 * MiB))
        wrong = http.post("/v1/simulate", json={}, headers={"Authorization": "Bearer nope"})
    for response in (small, bad_json, large, wrong):
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
    # Headers announcing 10 MB and no body at all: answered at once, so nothing was waited
    # for (a server that read the body first would wait for the 10 MB here).
    began = time.monotonic()
    answer = raw_answer(
        service,
        f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: {10 * MiB}\r\n\r\n".encode(),
    )
    assert answer.startswith(b"HTTP/1.1 401"), answer
    assert time.monotonic() - began < 2
    assert service.http.get("/v1/jobs").json()["jobs"] == []  # nothing got through


def test_bodies_over_the_cap_get_413_and_non_finite_numbers_422(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()
    token = service.http.headers["Authorization"].encode()
    declared = raw_answer(
        service,
        b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: " + token
        + f"\r\nContent-Length: {2 * MiB}\r\n\r\n".encode(),
    )  # fmt: skip
    assert declared.startswith(b"HTTP/1.1 413"), declared

    def chunks() -> Any:  # no Content-Length: counted as it streams in
        for _ in range(40):
            yield b" " * 64 * 1024

    streamed = service.http.post("/v1/jobs", content=chunks())
    assert streamed.status_code == 413, streamed.text
    assert "1,048,576 bytes" in streamed.json()["detail"]

    def post(text: str) -> httpx.Response:
        return service.http.post(
            "/v1/jobs", content=text.encode(), headers={"content-type": "application/json"}
        )

    spec = '{"kind": "noop", "workers": 1, %s}'
    assert detail_locations(post(spec % '"deadline_seconds": NaN')) == [
        ["body", "deadline_seconds"]
    ]
    assert detail_locations(post(spec % '"params": {"a": [1, -Infinity]}')) == [
        ["body", "params", "a", 1]
    ]
    simulate = service.http.post(
        "/v1/simulate",
        content=b'{"seconds": Infinity}',
        headers={"content-type": "application/json"},
    )
    assert detail_locations(simulate) == [["body", "seconds"]]
    nested = post("[" * 100_000 + "]" * 100_000)  # deep, within the cap: refused, no 500
    assert nested.status_code in (400, 422), nested.text
    assert service.http.get("/healthz").status_code == 200


# -- paths ------------------------------------------------------------------------------------


def test_paths_outside_the_roots_and_huge_synthetic_data_get_422(
    serve: Callable[..., ServiceProc],
    tmp_path: Path,
) -> None:
    data_root = tmp_path / "data-root"
    (data_root / "nested").mkdir(parents=True)
    (data_root / "escape.csv").symlink_to("/etc/passwd")
    (data_root / "linked").symlink_to("/etc")
    service = serve("--data-root", str(data_root))
    artifacts_root = service.data / "artifacts"

    def submit(params: dict[str, str]) -> httpx.Response:
        return service.http.post(
            "/v1/jobs", json={"kind": "xgboost", "workers": 1, "params": params}
        )

    for params, field in [
        ({"data": "/etc/passwd.csv"}, "data"),
        ({"data": "../outside.csv"}, "data"),
        ({"data": "nested/../../outside.csv"}, "data"),
        ({"data": "escape.csv"}, "data"),  # a symlink inside the root, to outside
        ({"data": "linked/*.csv"}, "data"),
        ({"data": "*/train.csv"}, "data"),  # a glob in a folder's name: unknowable here
        ({"data": "~/train.csv"}, "data"),
        ({"eval_data": "/dev/zero.csv"}, "eval_data"),
        ({"artifacts": "/tmp/elsewhere"}, "artifacts"),
        ({"artifacts": str(data_root)}, "artifacts"),  # the data root is not for artifacts
        ({"data": "synthetic:100000000x10"}, "data"),
        ({"data": "synthetic:100x100000"}, "data"),
    ]:
        response = submit(params)
        assert detail_locations(response) == [["body", "params", field]], params
    assert not (Path("/tmp/elsewhere")).exists()  # nothing was made for a refused path

    made = submit({"data": "nested/train-*.csv", "artifacts": "runs/one", "rounds": "1"})
    assert made.status_code == 201, made.text
    stored = made.json()["spec"]["params"]
    assert stored["data"] == str(data_root / "nested" / "train-*.csv")  # absolute: as checked
    assert stored["artifacts"] == str(artifacts_root / "runs" / "one")
    record = wait_state(service, made.json()["id"], {"FAILED"}, timeout=90)
    assert record["attempts"][0]["members"][0]["exit_code"] == 2  # the member found no file
    assert not (artifacts_root / "runs").exists()  # the API made no folder (nor the member)
    synthetic = submit({"data": "synthetic:2000x5", "rounds": "1"})
    assert synthetic.status_code == 201, synthetic.text
    builtin = submit({"data": "breast_cancer", "rounds": "1"})
    assert builtin.status_code == 201, builtin.text


# -- the simulator ------------------------------------------------------------------------------


def test_simulate_refuses_trace_and_work_beyond_its_budget(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()
    trace = service.http.post("/v1/simulate", json={"delay": "trace:/dev/zero"})
    assert detail_locations(trace) == [["body", "delay"]]
    assert "coordinator simulate" in trace.json()["detail"][0]["msg"]
    costly = service.http.post(
        "/v1/simulate", json={"workers": 1000, "seconds": 1000, "delay": "exp:0,0.001"}
    )
    assert ["body", "delay"] in detail_locations(costly)
    assert ["body", "workers"] in detail_locations(costly)
    # The bound counts methods: one method fits where three of the same size do not.
    one = {"barrier": "asp", "workers": 10000, "seconds": 300, "delay": "exp:1,1"}  # 1.5M steps
    assert service.http.post("/v1/simulate", json=one).status_code == 200
    three = service.http.post("/v1/simulate", json={**one, "barrier": "asp,bsp,ssp:1"})
    assert ["body", "barrier"] in detail_locations(three)


def test_a_simulation_whose_client_leaves_is_killed(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()
    left: list[float] = []

    # Gives up after 0.3 s, and hangs up: the spawned interpreter's start-up alone outlasts
    # that, and the worst-case run takes seconds more.
    def impatient() -> None:
        with httpx.Client(base_url=service.url, headers=service.http.headers) as http:
            try:
                http.post("/v1/simulate", json=WORST_SIMULATION, timeout=httpx.Timeout(5, read=0.3))
            except httpx.ReadTimeout:
                left.append(time.monotonic())

    client = threading.Thread(target=impatient)
    client.start()
    running = wait_until(lambda: simulation_processes(service.process.pid), 10, "the simulation")
    client.join(30)
    assert left, "the simulation answered within 0.3 s: nothing was left running"
    _, alive = psutil.wait_procs(running, timeout=10)
    took = time.monotonic() - left[0]
    print(f"\nkilled {took:.2f}s after its client left")
    assert not alive and took < 1.0, took
    assert service.http.post("/v1/simulate", json={"workers": 10, "seconds": 10}).status_code == 200


def test_worst_case_simulations_leave_every_endpoint_answering_and_sigterm_stops_it(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()  # --grace 3
    spec = {"id": "seen", "kind": "noop", "workers": 1, "params": {"seconds": 0}}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    wait_state(service, "seen", {"SUCCEEDED"}, timeout=60)
    long = {"id": "long", "kind": "noop", "workers": 1, "params": {"seconds": 300}}
    assert service.http.post("/v1/jobs", json=long).status_code == 201
    wait_state(service, "long", {"RUNNING"}, timeout=60)
    streaming: list[str] = []

    def follow(path: str) -> None:  # streams that would go on for minutes
        with httpx.Client(base_url=service.url, headers=service.http.headers) as http:
            try:
                with http.stream("GET", path, timeout=120) as response:
                    streaming.append(path)
                    for _ in response.iter_bytes():
                        pass
            except httpx.TransportError:
                pass

    streams = [
        threading.Thread(target=follow, args=(path,), daemon=True)
        for path in ["/v1/jobs/long/events", "/v1/jobs/long/logs?follow=true",
                     "/v1/jobs/long/live"]
    ]  # fmt: skip
    for stream in streams:
        stream.start()
    wait_until(lambda: len(streaming) == 3, 30, "the streams to be open")

    outcomes: list[int | str] = []

    def simulate() -> None:
        with httpx.Client(base_url=service.url, headers=service.http.headers) as http:
            try:
                response = http.post("/v1/simulate", json=WORST_SIMULATION, timeout=120)
                outcomes.append(response.status_code)
            except httpx.TransportError as exc:  # the service stopped under it
                outcomes.append(type(exc).__name__)

    clients = [threading.Thread(target=simulate) for _ in range(8)]
    for client in clients:
        client.start()
    worst: dict[str, float] = {}
    with httpx.Client(base_url=service.url, headers=service.http.headers, timeout=10) as http:
        wait_until(lambda: len(outcomes) >= 5, 30, "the simulations beyond the queue to be refused")
        ended = time.monotonic() + 6  # while the admitted ones run (seconds each)
        while time.monotonic() < ended:
            for path in ["/healthz", "/v1/jobs", "/v1/jobs/seen/logs", "/v1/jobs/seen/series"]:
                began = time.monotonic()
                assert http.get(path).status_code == 200, path
                worst[path] = max(worst.get(path, 0.0), time.monotonic() - began)
        print(f"\nslowest answers under 8 worst-case simulations: {worst}")
        assert all(took < LATENCY_BOUND for took in worst.values()), worst
        assert sorted(o for o in outcomes if isinstance(o, int)).count(429) >= 5, outcomes
        # SIGTERM with simulations still running and queued: the service ends within its
        # grace, and no simulation process outlives it.
        assert len(outcomes) < 8, "every simulation ended before the SIGTERM: nothing tested"
        running = simulation_processes(service.process.pid)
        assert running, "no simulation process was running"
        asked = time.monotonic()
        service.process.terminate()
        service.process.wait(15)
        took = time.monotonic() - asked
    print(f"stopped {took:.2f}s after SIGTERM")
    assert took < 3, f"{took:.1f}s: more than the grace"
    for thread in clients + streams:
        thread.join(30)
        assert not thread.is_alive(), "a client still waits on the stopped service"
    _, alive = psutil.wait_procs(running, timeout=5)
    assert not alive, f"simulations outlived the service: {alive}"


# -- tokens ---------------------------------------------------------------------------------------


def test_the_generated_token_file_is_private_kept_and_linked_in_the_fragment_only(
    serve: Callable[..., ServiceProc],
    tmp_path: Path,
) -> None:
    data = tmp_path / "kept"
    first = serve(data=data, exec_token=False)
    token_file = data / "api-token"
    assert oct(token_file.stat().st_mode & 0o777) == "0o600"
    token = first.generated_token()
    assert token is not None and len(token) >= 32
    link = first.dashboard_link()
    assert link == f"{first.url}/#token={token}" and "?" not in link
    for made in ("artifacts", "data", "work"):  # serve's umask: private
        assert (data / made).stat().st_mode & 0o077 == 0, made
    with unauthenticated(first) as http:
        assert http.get("/v1/jobs").status_code == 401
        assert http.get("/v1/whoami").json() == {"role": "none", "auth": True}
    assert first.http.get("/v1/whoami").json() == {"role": "submit", "auth": True}
    first.stop()
    second = serve(data=data, exec_token=False)  # a restart keeps the token its users have
    assert second.generated_token() == token
    assert second.http.get("/v1/jobs").status_code == 200


def test_a_token_file_others_can_read_is_refused_naming_it(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"submit {SUBMIT_TOKEN}\n")
    tokens.chmod(0o644)
    data = tmp_path / "data"
    data.mkdir()
    (data / "api-token").write_text(f"submit {SUBMIT_TOKEN}\n")
    (data / "api-token").chmod(0o640)
    for extra in (["--token-file", str(tokens)], []):
        result = subprocess.run(
            [sys.executable, "-m", "coordinator", "serve", "--data-dir", str(data),
             "--port", "0", "--etcd", unreachable_etcd(), *extra],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "COLUMNS": "500"},  # rich must not wrap the path
        )  # fmt: skip
        named = str(tokens) if extra else str(data / "api-token")
        assert result.returncode == 2, result.stderr
        assert f"chmod 600 {named}" in result.stderr, result.stderr


def test_the_cli_finds_the_token_of_a_service_on_this_host(
    serve: Callable[..., ServiceProc],
    tmp_path: Path,
) -> None:
    service = serve()
    env = {k: v for k, v in os.environ.items() if k not in ("COORDINATOR_TOKEN",)}

    def cli(*args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "coordinator", *args, "--server", service.url],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
            env={**env, **extra_env},
        )  # fmt: skip

    found = cli("submit", "noop", "--workers", "1", "--id", "by-cli",
                COORDINATOR_DATA=str(service.data))  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert "by-cli: PENDING" in found.stdout
    # ./coordinator-data (serve's default data directory) is looked in too.
    (tmp_path / "coordinator-data").symlink_to(service.data)
    listed = cli("jobs")
    assert listed.returncode == 0 and "by-cli" in listed.stdout, listed.stderr
    nowhere = cli("jobs", COORDINATOR_DATA=str(tmp_path / "none"))
    assert nowhere.returncode == 2 and "401" in nowhere.stderr
    explicit = cli("jobs", "--token", "wrong-token-0123456789")  # --token comes first
    assert explicit.returncode == 2 and "401" in explicit.stderr


# -- parameters reach the member whole ------------------------------------------------------------


def test_a_param_with_commas_stays_one_parameter() -> None:
    assert parse_params(["data=a.csv,artifacts=/elsewhere", "x=1"]) == {
        "data": "a.csv,artifacts=/elsewhere",
        "x": "1",
    }
    assert parse_param_list("a=1, b=2") == {"a": "1", "b": "2"}  # the manifests' env form
    # A real worker: one --param whose value holds a comma and a second `name=`.
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "worker", "--job", "j", "--world-size", "1",
         "--etcd", unreachable_etcd(), "--kind", "noop", "--param", "seconds=1,colour=red",
         "--connect-timeout", "0.5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "'1,colour=red' is not a number" in result.stderr  # not "unknown parameter colour"
