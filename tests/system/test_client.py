"""`coordinator.client` against a real `coordinator serve`: typed records, typed errors,
streams that outlast keep-alives, and the example users start from."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator.client import (
    Client,
    Conflict,
    NotFound,
    Refused,
    Unauthorized,
    Unreachable,
)
from coordinator.jobs.kinds import KINDS
from coordinator.service.model import JobSpec, JobState, SimulationRequest
from tests.support.service import ServiceProc, free_port

pytestmark = pytest.mark.one_etcd  # what it tests is the service's HTTP side

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def quiet_service(serve: Callable[..., ServiceProc]) -> ServiceProc:
    """Keep-alives every 0.3 s (15 s by default): a 3 s job is quiet for ten of them."""
    return serve("--events-ping", "0.3")


@pytest.fixture
def client(quiet_service: ServiceProc, monkeypatch: pytest.MonkeyPatch) -> Iterator[Client]:
    # No token given: found as the CLI finds it, in $COORDINATOR_DATA/api-token.
    monkeypatch.delenv("COORDINATOR_TOKEN", raising=False)
    monkeypatch.setenv("COORDINATOR_DATA", str(quiet_service.data))
    with Client(quiet_service.url) as found:
        yield found


def test_a_job_submitted_followed_and_read_back_as_the_service_s_own_models(
    client: Client,
) -> None:
    spec = JobSpec(id="typed", kind="noop", workers=2, params={"seconds": "3"})
    job = client.submit(spec)
    assert job.id == "typed" and job.state == JobState.PENDING
    assert client.submit(spec).uid == job.uid  # the same submit again: the same job
    states = [record.state for record in client.events("typed")]  # quiet for 3 s
    assert states[-1] == JobState.SUCCEEDED and JobState.RUNNING in states
    assert client.wait("typed", timeout=10).state == JobState.SUCCEEDED
    assert [record.id for record in client.jobs(state="SUCCEEDED")] == ["typed"]
    assert list(client.jobs(kind="steps")) == []
    lines = list(client.logs("typed", rank=1))
    assert lines and all(line.startswith("[rank 1] ") for line in lines)
    client.delete("typed")
    with pytest.raises(NotFound, match="404"):
        client.get("typed")


def test_wait_gives_up_at_its_timeout_and_cancel_ends_the_job(client: Client) -> None:
    client.submit({"id": "long", "kind": "noop", "workers": 1, "params": {"seconds": "60"}})
    with pytest.raises(TimeoutError, match="long"):
        client.wait("long", timeout=1)
    with pytest.raises(Conflict, match="409"):
        client.delete("long")  # still live
    assert client.cancel("long").cancel_requested_at is not None
    assert client.wait("long", timeout=30).state == JobState.CANCELLED


def test_refusals_are_typed_and_name_their_fields(client: Client) -> None:
    with pytest.raises(Refused) as refused:
        client.submit({"kind": "noop", "workers": 0})
    assert refused.value.status == 422 and "workers" in refused.value.fields
    with pytest.raises(Refused) as refused:
        client.submit({"kind": "noop", "workers": 1, "params": {"colour": "red"}})
    assert any(field.startswith("params") for field in refused.value.fields)
    client.submit({"id": "taken", "kind": "noop", "workers": 1})
    with pytest.raises(Conflict):
        client.submit({"id": "taken", "kind": "noop", "workers": 2})


def test_kinds_and_the_simulator_answer_typed(client: Client) -> None:
    assert {kind.name for kind in client.kinds()} == set(KINDS)
    result = client.simulate(SimulationRequest(barrier="bsp,asp", workers=8, seconds=10))
    assert [method.label for method in result.methods] == ["bsp", "asp"]


def test_a_wrong_token_and_a_dead_address_say_what_to_do(
    quiet_service: ServiceProc, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wrong = Client(quiet_service.url, token="not-the-token")
    with wrong, pytest.raises(Unauthorized, match=r"401.*\(token: given\)"):
        wrong.get("any")
    monkeypatch.delenv("COORDINATOR_TOKEN", raising=False)
    monkeypatch.setenv("COORDINATOR_DATA", str(tmp_path))  # no api-token there
    none = Client(quiet_service.url)
    with none, pytest.raises(Unauthorized, match=re.escape(f"or {tmp_path}/api-token")):
        none.get("any")
    nowhere = Client(f"http://127.0.0.1:{free_port()}", token="t")
    with nowhere, pytest.raises(Unreachable, match="coordinator serve"):
        nowhere.get("any")


def test_the_client_example_runs_against_a_real_service(quiet_service: ServiceProc) -> None:
    env = {k: v for k, v in os.environ.items() if k != "COORDINATOR_TOKEN"}
    env |= {"COORDINATOR_SERVER": quiet_service.url, "COORDINATOR_DATA": str(quiet_service.data)}
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "client.py")],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    # A failure shows the service's side too: its log and its jobs as they ended up.
    listed = quiet_service.http.get("/v1/jobs").json()["jobs"]
    jobs = [(job["id"], job["state"], job["conditions"][-1]["reason"]) for job in listed]
    assert done.returncode == 0, f"{done.stderr[-3000:]}\njobs: {jobs}\n{quiet_service.output()}"
    assert "SUCCEEDED - every member exited 0" in done.stdout
    assert "[rank 0] " in done.stdout  # its log lines
    assert "refused: {'params'" in done.stdout
    assert done.stdout.rstrip().endswith("CANCELLED")


@pytest.mark.slow  # quiet for longer than the default keep-alive interval (15 s)
def test_a_job_quiet_past_the_default_keep_alive_is_followed_by_the_client_and_the_cli(
    serve: Callable[..., ServiceProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    service = serve()  # keep-alives every 15 s, as shipped
    monkeypatch.delenv("COORDINATOR_TOKEN", raising=False)
    monkeypatch.setenv("COORDINATOR_DATA", str(service.data))
    spec = {"id": "quiet", "kind": "noop", "workers": 1, "params": {"seconds": "17"}}
    with Client(service.url) as client:
        client.submit(spec)
        with subprocess.Popen(
            [sys.executable, "-m", "coordinator", "submit", "noop", "--id", "quiet", "--workers",
             "1", "--param", "seconds=17", "--wait", "--server", service.url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ) as waited:  # fmt: skip
            try:
                states = [record.state for record in client.events("quiet")]
                out, errors = waited.communicate(timeout=60)
            finally:
                waited.kill()
    assert states[-1] == JobState.SUCCEEDED
    assert waited.returncode == 0 and "quiet: SUCCEEDED" in out, errors
