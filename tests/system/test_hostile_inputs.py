"""Every hostile input gets a 4xx (issue 28, item 6), against a real `coordinator serve`.

Non-finite numbers, lone surrogates and NULs in every kind of field (each once a 500)
get a 422 naming the field; values a member would choke on are refused at submit; a
simulation's deadline starts with its run, and one cut by SIGTERM answers 503; the
generated token is `submit` and reaches a log only as the name of its file; a token
file of another owner is refused; a member's password file goes when the member ends.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
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

from coordinator.etcd.server import EmbeddedEtcd
from coordinator.service.rest import simulation
from tests.support.agents import registered
from tests.support.hostile import OTHER_TYPES, PARAM_CASES, RAW_BODIES, job_cases
from tests.support.processes import unreachable_etcd
from tests.support.service import (
    SUBMIT_TOKEN,
    ServiceProc,
    free_port,
    simulation_processes,
    wait_state,
)
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd
JSON = {"content-type": "application/json"}
#: Some 10 s of pBSP (as test_api_boundary's worst case): still running at the SIGTERM.
LONG_SIMULATION = {"barrier": "pbsp:10", "workers": 10000, "seconds": 799, "delay": "exp:1,3"}


def test_no_hostile_value_gets_a_5xx_and_each_422_names_its_field(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()
    cases = job_cases()
    for case in cases:
        response = service.http.post(case.path, content=case.body.encode(), headers=JSON)
        assert response.status_code == 422, (case, response.text)
        assert [item["loc"] for item in response.json()["detail"]] == [["body", *case.loc]], case
    for kind, params, named in PARAM_CASES:  # the member would choke on these
        spec: dict[str, Any] = {"kind": kind, "workers": 1, "params": params}
        if kind == "command":
            spec["command"] = ["/bin/true"]
        response = service.http.post("/v1/jobs", json=spec)
        assert response.status_code == 422, (params, response.text)
        assert named in response.json()["detail"][0]["msg"], response.text
    # Bodies of other types, and bytes that are not UTF-8: FastAPI's own 422 echoes them.
    for content_type in (*OTHER_TYPES, None):
        for raw in RAW_BODIES:
            headers = {"content-type": content_type} if content_type else {}
            answer = service.http.post("/v1/jobs", content=raw, headers=headers)
            assert answer.status_code in (400, 422), (content_type, raw, answer.text)
    # Paths and queries: decoded by the server (an undecodable byte becomes U+FFFD); a
    # filter that can match nothing finds nothing (200), a job id no job has is a 404.
    for method, path in [
        ("GET", "/v1/jobs?label=a%00%ED%A0%80=b"),
        ("GET", "/v1/jobs?kind=%00&state=%ED%A0%80"),
        ("GET", "/v1/jobs/%00"),
        ("GET", "/v1/jobs/%ED%A0%80"),
        ("GET", "/v1/jobs/a%00b/logs"),
        ("POST", "/v1/jobs/%00/cancel"),
        ("DELETE", "/v1/jobs/%ED%A0%80"),
    ]:
        answer = service.http.request(method, path)
        assert answer.status_code in (200, 404, 422), (path, answer.status_code, answer.text)
    jobs = service.http.get("/v1/jobs").json()["jobs"]
    assert jobs == [], "a hostile submit was stored"
    assert service.http.get("/healthz").status_code == 200
    sent = len(cases) + len(PARAM_CASES) + 5 * len(RAW_BODIES) + 7
    print(f"\n{sent} hostile requests: no 5xx")


# -- the simulator --------------------------------------------------------------------------


def test_a_simulations_deadline_counts_from_its_start_not_its_wait() -> None:
    """Two runs of 2.5 s on one slot with a 4.5 s deadline: the second waits some 3 s (the
    first's interpreter start-up and its work), then runs as long; counted from the
    queue it would pass its deadline, counted from its start it does not."""
    runner = simulation.Runner(running=1, waiting=1, timeout=4.5)

    async def never_gone() -> bool:
        return False

    async def both() -> list[Any]:
        import asyncio

        runs = [runner.run(time.sleep, 2.5, never_gone) for _ in range(2)]
        return await asyncio.gather(*runs, return_exceptions=True)

    import asyncio

    began = time.monotonic()
    outcomes = asyncio.run(both())
    took = time.monotonic() - began
    print(f"\ntwo queued runs took {took:.1f}s; deadline 4.5s each")
    assert outcomes == [None, None], outcomes
    assert took > 4.5, "the runs overlapped: the queue was not tested"


def test_a_simulation_cut_by_sigterm_answers_503(serve: Callable[..., ServiceProc]) -> None:
    service = serve()
    outcomes: list[int | str] = []

    def simulate() -> None:
        with httpx.Client(base_url=service.url, headers=service.http.headers) as http:
            try:
                response = http.post("/v1/simulate", json=LONG_SIMULATION, timeout=60)
                outcomes.append(response.status_code)
            except httpx.TransportError as exc:
                outcomes.append(type(exc).__name__)

    client = threading.Thread(target=simulate)
    client.start()
    running = wait_until(
        lambda: simulation_processes(service.process.pid), 30, "a simulation to run"
    )
    service.process.send_signal(signal.SIGTERM)
    client.join(30)
    service.process.wait(15)
    assert outcomes == [503], outcomes
    _, alive = psutil.wait_procs(running, timeout=5)
    assert not alive


def test_stopping_ends_the_running_and_the_queued_simulations() -> None:
    """`stop` (what SIGTERM calls) ends a run and a request waiting behind it, both with
    Stopping (503), and refuses what comes after."""
    import asyncio

    runner = simulation.Runner(running=1, waiting=1, timeout=60)

    async def never_gone() -> bool:
        return False

    async def scenario() -> tuple[list[Any], float]:
        runs = [asyncio.ensure_future(runner.run(time.sleep, 30, never_gone)) for _ in range(2)]
        while not runner._processes:  # the first one's process has started
            await asyncio.sleep(0.01)
        began = time.monotonic()
        runner.stop()
        outcomes = await asyncio.gather(*runs, return_exceptions=True)
        return outcomes, time.monotonic() - began

    outcomes, took = asyncio.run(scenario())
    assert [type(outcome) for outcome in outcomes] == [simulation.Stopping] * 2, outcomes
    assert took < 2, took
    with pytest.raises(simulation.Stopping):
        asyncio.run(runner.run(time.sleep, 0, never_gone))


# -- tokens ---------------------------------------------------------------------------------


def test_the_generated_token_is_submit_and_exec_needs_a_token_file(
    serve: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    data = tmp_path / "made"
    made = serve(data=data, exec_token=False)
    assert made.http.get("/v1/whoami").json() == {"role": "submit", "auth": True}
    program = {"kind": "command", "workers": 1, "command": ["/bin/true"]}
    refused = made.http.post("/v1/jobs", json=program)
    assert refused.status_code == 403 and "exec" in refused.json()["detail"], refused.text
    token = made.generated_token()
    assert token is not None and token not in made.output()  # the log names the file only
    assert str(data / "api-token") in made.output()
    made.stop()
    # A file an earlier version made, with an exec token: read as submit.
    (data / "api-token").write_text(f"exec {token}\n")
    again = serve(data=data, exec_token=False)
    assert again.http.get("/v1/whoami").json()["role"] == "submit"
    assert again.http.post("/v1/jobs", json=program).status_code == 403
    # An explicit token file gives exec.
    given = serve()
    assert given.http.get("/v1/whoami").json()["role"] == "exec"
    assert given.http.post("/v1/jobs", json=program).status_code == 201


def test_the_dashboard_link_carries_the_token_only_to_a_terminal(
    etcd_server: EmbeddedEtcd, namespace: str, tmp_path: Path
) -> None:
    data = tmp_path / "tty"
    data.mkdir()
    port = free_port()
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "serve", "--port", str(port), "--namespace",
         namespace, "--data-dir", str(data), "--etcd", etcd_server.endpoint],
        stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal,
        env={**os.environ, "COLUMNS": "500"},
    )  # fmt: skip
    os.close(terminal)
    shown = b""
    try:
        deadline = time.monotonic() + 60
        while b"dashboard:" not in shown or not shown.endswith(b"\n"):
            assert time.monotonic() < deadline, f"no link printed: {shown!r}"
            ready, _, _ = select.select([controller], [], [], 1)
            if ready:
                try:
                    shown += os.read(controller, 4096)
                except OSError:  # the service ended
                    break
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        os.close(controller)
    token = (data / "api-token").read_text().split("\n")[-2].split()[1]
    assert f"#token={token}".encode() in shown, shown


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file away")
def test_a_token_file_of_another_owner_is_refused_naming_it(tmp_path: Path) -> None:
    for made_by_serve in (False, True):
        data = tmp_path / f"data-{made_by_serve}"
        data.mkdir()
        tokens = data / "api-token" if made_by_serve else tmp_path / "tokens"
        tokens.write_text(f"submit {SUBMIT_TOKEN}\n")
        tokens.chmod(0o600)
        os.chown(tokens, 65534, 65534)  # nobody: it could write itself a token
        extra = [] if made_by_serve else ["--token-file", str(tokens)]
        result = subprocess.run(
            [sys.executable, "-m", "coordinator", "serve", "--data-dir", str(data),
             "--port", "0", "--etcd", unreachable_etcd(), *extra],
            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "500"},
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert "owned by uid 65534" in result.stderr and str(tokens) in result.stderr


# -- member password files ------------------------------------------------------------------


def _password_file(pid: int) -> Path:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    environment = dict(item.decode().partition("=")[::2] for item in raw if item)
    return Path(environment["COORDINATOR_ETCD_PASSWORD_FILE"])


@pytest.mark.parametrize("ending", ["succeeds", "killed"])
def test_a_members_password_file_is_deleted_when_it_ends(
    serve: Callable[..., ServiceProc], ending: str
) -> None:
    service = serve()
    seconds = 2 if ending == "succeeds" else 300
    spec = {"id": "pw", "kind": "noop", "workers": 2, "params": {"seconds": seconds}}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    running = wait_state(service, "pw", {"RUNNING"}, timeout=60)
    members = running["attempts"][0]["members"]
    files = [_password_file(member["pid"]) for member in members]
    assert all(path.exists() for path in files), files
    if ending == "killed":
        os.killpg(members[1]["pid"], signal.SIGKILL)
    final = wait_state(service, "pw", {"SUCCEEDED", "FAILED"}, timeout=60)
    assert final["state"] == ("SUCCEEDED" if ending == "succeeds" else "FAILED")
    wait_until(lambda: not any(path.exists() for path in files), 10, "the password files to go")
    assert json.dumps(final)  # the record stayed readable


def test_an_agents_members_password_files_are_deleted_when_they_end(
    serve: Callable[..., ServiceProc], agents: Any, etcd: Any, tmp_path: Path
) -> None:
    agents("--id", "pw-agent", "--slots", "2")
    wait_until(lambda: registered(etcd, "pw-agent"), 30, "the agent to register")
    service = serve("--default-launcher", "agents")
    spec = {"id": "pw-agents", "kind": "noop", "workers": 2, "params": {"seconds": 2}}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    wait_state(service, "pw-agents", {"RUNNING"}, timeout=60)
    files = list((tmp_path / "a0").rglob("member-*.password"))  # the agent's data dir
    assert len(files) == 2, files
    final = wait_state(service, "pw-agents", {"SUCCEEDED", "FAILED"}, timeout=60)
    assert final["state"] == "SUCCEEDED", final["conditions"]
    wait_until(lambda: not any(path.exists() for path in files), 10, "the password files to go")
