"""The REST service end to end: a real uvicorn on loopback, real etcd, real member processes.

Every service and every member it started is stopped at the end of each test,
also on failure (members are found from the pidfiles in the data directories).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from coordinator.etcd.client import Etcd
from coordinator.service.model import JobRecord, JobSpec, JobState
from coordinator.service.states import IllegalTransition, advance
from tests.support.service import (
    READ_TOKEN,
    SUBMIT_TOKEN,
    ServiceProc,
    kill_members,
    no_member_runs,
    sse,
    wait_state,
)
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd


def member_pids(record: dict[str, Any]) -> list[int]:
    return [m["pid"] for a in record["attempts"] for m in a["members"] if m.get("pid")]


# -- the state machine on its own -----------------------------------------------


def test_terminal_states_are_final_and_every_move_is_recorded() -> None:
    spec = JobSpec(id="j", kind="noop", workers=1)
    record = JobRecord(
        id="j", uid="0" * 32, spec=spec, state=JobState.PENDING, conditions=[], submitted_at=0
    )
    record = advance(record, JobState.STARTING, "attempt 1", 1.0)
    record = advance(record, JobState.SUCCEEDED, "every member exited 0", 2.0)
    assert [c.state for c in record.conditions] == [JobState.STARTING, JobState.SUCCEEDED]
    with pytest.raises(IllegalTransition, match="SUCCEEDED -> RUNNING"):
        advance(record, JobState.RUNNING, "late news", 3.0)


# -- submitting and following ----------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("noop", {}),
        ("steps", {"method": "ssp", "staleness": 1, "num_steps": 20, "step_seconds": 0.01}),
        ("xgboost", {"rounds": 8}),
    ],
)
def test_a_submitted_job_succeeds_with_its_events_in_order_and_its_members_shown(
    kind: str, params: dict[str, Any], serve: Callable[..., ServiceProc], etcd: Etcd
) -> None:
    service = serve()
    spec = {"id": f"{kind}-ok", "kind": kind, "workers": 3, "params": params}
    response = service.http.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    assert response.headers["location"] == f"/v1/jobs/{kind}-ok"
    events = sse(service, f"{kind}-ok", last="1")  # every change since it was submitted
    states = [record["state"] for _, record in events]
    revisions = [int(revision) for revision, _ in events]
    assert revisions == sorted(set(revisions))  # in order, none twice
    seen = [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s]
    assert seen == ["PENDING", "STARTING", "RUNNING", "SUCCEEDED"], states

    record = service.http.get(f"/v1/jobs/{kind}-ok").json()
    members = record["attempts"][0]["members"]
    assert sorted(m["rank"] for m in members) == [0, 1, 2]
    assert all(m["exit_code"] == 0 and m["phase"] == "done" and m["address"] for m in members)
    if kind == "xgboost":
        assert record["progress"]["step"] == record["progress"]["total"] == 8
        assert "train-logloss" in record["progress"]["metrics"]
        assert Path(record["artifacts"]["model_path"]).is_file()
    # The members cleaned up after themselves; the service cleared the attempt's keys.
    assert etcd.count_prefix(etcd.key("jobs", f"{kind}-ok", "rendezvous") + "/") == 0


def test_submits_are_idempotent_and_bad_ones_are_named(serve: Callable[..., ServiceProc]) -> None:
    service = serve()
    spec = {"id": "same", "kind": "noop", "workers": 2, "params": {"seconds": 0}}
    first = service.http.post("/v1/jobs", json=spec)
    again = service.http.post("/v1/jobs", json=spec)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["submitted_at"] == first.json()["submitted_at"]
    changed = service.http.post("/v1/jobs", json={**spec, "workers": 3})
    assert changed.status_code == 409 and "another spec" in changed.json()["detail"]

    def refused(body: dict[str, Any]) -> dict[str, Any]:
        response = service.http.post("/v1/jobs", json=body)
        assert response.status_code == 422, response.text
        return response.json()["detail"][0]

    assert refused({"kind": "noop", "workers": 2, "params": {"colour": "red"}})["loc"] == [
        "body",
        "params",
    ]
    assert "colour" in refused({"kind": "noop", "workers": 2, "params": {"colour": "x"}})["msg"]
    assert refused({"kind": "nope", "workers": 2})["loc"] == ["body", "kind"]
    too_big = refused({"kind": "noop", "workers": 5})
    assert too_big["loc"] == ["body", "workers"] and "never fit" in too_big["msg"]
    assert refused({"kind": "noop", "workers": 0})["loc"] == ["body", "workers"]
    assert refused({"kind": "noop", "workers": 1, "id": "Bad_Id"})["loc"] == ["body", "id"]
    assert service.http.get("/v1/jobs/nobody").status_code == 404
    assert service.http.post("/v1/jobs/nobody/cancel").status_code == 404


def test_jobs_are_listed_in_pages_and_filtered(serve: Callable[..., ServiceProc]) -> None:
    service = serve()
    for n in range(5):
        spec = {"id": f"list-{n}", "kind": "noop", "workers": 1, "labels": {"team": f"t{n % 2}"}}
        assert service.http.post("/v1/jobs", json=spec).status_code == 201
    ids, token = [], None
    while True:
        params: dict[str, Any] = {"limit": 2} | ({"page_token": token} if token else {})
        page = service.http.get("/v1/jobs", params=params).json()
        ids += [job["id"] for job in page["jobs"]]
        token = page["next_page_token"]
        if token is None:
            break
    assert ids == [f"list-{n}" for n in range(5)]
    team = service.http.get("/v1/jobs", params={"label": "team=t1"}).json()["jobs"]
    assert [job["id"] for job in team] == ["list-1", "list-3"]


# -- stopping ----------------------------------------------------------------------


def test_cancel_stops_the_members_within_the_grace_and_leaves_no_keys(
    serve: Callable[..., ServiceProc], etcd: Etcd
) -> None:
    service = serve()
    spec = {"id": "long", "kind": "noop", "workers": 3, "params": {"seconds": 120}}
    service.http.post("/v1/jobs", json=spec)
    running = wait_state(service, "long", {"RUNNING"})
    assert len(member_pids(running)) == 3
    asked = time.monotonic()
    assert service.http.post("/v1/jobs/long/cancel").status_code == 202
    assert service.http.post("/v1/jobs/long/cancel").status_code == 202  # idempotent
    record = wait_state(service, "long", {"CANCELLED"}, timeout=30)
    assert time.monotonic() - asked < 3 + 5  # the grace, and a few ticks
    assert no_member_runs(record)
    assert etcd.count_prefix(etcd.key("jobs", "long", "rendezvous") + "/") == 0
    assert record["conditions"][-1]["reason"] == "cancelled by request"
    assert list(service.data.glob("logs/long-*/attempt-1/member-*.log"))
    etcd.put(etcd.key("jobs", "long", "left", "by-a-member"), "x")  # e.g. a trainer's clock
    assert service.http.delete("/v1/jobs/long").status_code == 204
    assert etcd.count_prefix(etcd.key("jobs", "long") + "/") == 0  # every key it left
    assert service.http.get("/v1/jobs/long").status_code == 404
    assert not list(service.data.glob("logs/long-*"))  # its logs are gone with it


def test_a_live_job_cannot_be_deleted(serve: Callable[..., ServiceProc]) -> None:
    service = serve()
    service.http.post("/v1/jobs", json={"id": "live", "kind": "noop", "workers": 1,
                                        "params": {"seconds": 60}})  # fmt: skip
    wait_state(service, "live", {"RUNNING"})
    assert service.http.delete("/v1/jobs/live").status_code == 409
    service.http.post("/v1/jobs/live/cancel")
    wait_state(service, "live", {"CANCELLED"}, timeout=30)


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_killed_member_fails_the_job_or_restarts_it(
    restarts: int, serve: Callable[..., ServiceProc]
) -> None:
    service = serve()
    spec = {"id": "victim", "kind": "noop", "workers": 3, "params": {"seconds": 6},
            "max_restarts": restarts}  # fmt: skip
    service.http.post("/v1/jobs", json=spec)
    running = wait_state(service, "victim", {"RUNNING"})
    member = next(m for m in running["attempts"][0]["members"] if m["rank"] == 1)
    os.kill(member["pid"], signal.SIGKILL)
    if restarts == 0:
        record = wait_state(service, "victim", {"FAILED"}, timeout=30)
        assert "rank 1" in record["conditions"][-1]["reason"]
    else:
        record = wait_state(service, "victim", {"SUCCEEDED"}, timeout=60)
        states = [c["state"] for c in record["conditions"]]
        assert states.count("RESTARTING") == 1 and len(record["attempts"]) == 2
        assert "rank 1" in record["attempts"][0]["outcome"]
    assert no_member_runs(record)


# -- restarts and replicas ------------------------------------------------------------


def test_a_killed_service_restarted_finishes_its_jobs_without_starting_a_member_twice(
    serve: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    data = tmp_path / "service"
    first = serve(data=data)
    first.http.post("/v1/jobs", json={"id": "run", "kind": "noop", "workers": 2,
                                      "params": {"seconds": 6}})  # fmt: skip
    for n in range(3):  # these wait in the queue: 4 slots, 2 busy, 2 wanted each
        first.http.post("/v1/jobs", json={"id": f"queued-{n}", "kind": "noop", "workers": 2,
                                          "params": {"seconds": 1}})  # fmt: skip
    running = wait_state(first, "run", {"RUNNING"})
    first.kill()  # SIGKILL: no goodbye
    second = serve(data=data)
    for job in ["run", "queued-0", "queued-1", "queued-2"]:
        record = wait_state(second, job, {"SUCCEEDED"}, timeout=120)
        assert len(record["attempts"]) == 1
    finished = second.http.get("/v1/jobs/run").json()
    assert member_pids(finished) == member_pids(running)  # adopted, not started again
    assert len(list(data.glob("logs/*/*/member-*.pid"))) == 2 + 3 * 2


def test_two_replicas_launch_each_attempt_exactly_once(
    serve: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    replicas = [serve(), serve()]
    for n in range(4):
        replicas[n % 2].http.post("/v1/jobs", json={"id": f"pair-{n}", "kind": "noop",
                                                    "workers": 2})  # fmt: skip
    for n in range(4):
        record = wait_state(replicas[(n + 1) % 2], f"pair-{n}", {"SUCCEEDED"}, timeout=120)
        assert len(record["attempts"]) == 1 and len(record["attempts"][0]["members"]) == 2
    started = [p for r in replicas for p in r.data.glob("logs/*/*/member-*.pid")]
    assert len(started) == 4 * 2


# -- events, auth ------------------------------------------------------------------------


def test_an_events_client_that_reconnects_gets_every_event_exactly_once(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()
    spec = {"id": "follow", "kind": "xgboost", "workers": 2, "params": {"rounds": 30}}
    service.http.post("/v1/jobs", json=spec)
    first = sse(service, "follow", limit=2)
    rest = sse(service, "follow", last=first[-1][0])
    complete = sse(service, "follow", last="1")  # everything since the start, as a reference
    ids = [revision for revision, _ in first + rest]
    assert ids == [revision for revision, _ in complete if int(revision) >= int(ids[0])]
    assert len(ids) == len(set(ids)) and rest[-1][1]["state"] == "SUCCEEDED"


def test_tokens_are_required_and_roles_enforced(
    serve: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"read {READ_TOKEN}\nsubmit {SUBMIT_TOKEN}  # the CI's\n")
    tokens.chmod(0o600)
    service = serve("--token-file", str(tokens))
    spec = {"kind": "noop", "workers": 1}

    def as_(token: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"} if token else {}

    assert service.http.get("/healthz").status_code == 200
    assert service.http.get("/v1/jobs").status_code == 401
    assert service.http.get("/v1/jobs", headers=as_("wrong-token-0123456789")).status_code == 401
    assert service.http.get("/v1/jobs", headers=as_(READ_TOKEN)).status_code == 200
    assert service.http.post("/v1/jobs", json=spec, headers=as_(READ_TOKEN)).status_code == 403
    assert service.http.post("/v1/jobs", json=spec, headers=as_(SUBMIT_TOKEN)).status_code == 201
    # The page's /v1/whoami says the role the API grants: one parse of the header for both.
    odd = {"Authorization": f"bearer  {READ_TOKEN}"}  # another case, a second space
    assert service.http.get("/v1/jobs", headers=odd).status_code == 200
    roles = [(odd, "read"), (as_(SUBMIT_TOKEN), "submit"), (as_(None), "none"),
             (as_("wrong-token-0123456789"), "none")]  # fmt: skip
    for headers, role in roles:
        whoami = service.http.get("/v1/whoami", headers=headers).json()
        assert whoami == {"role": role, "auth": True}, headers


def test_without_tokens_the_service_refuses_to_listen_beyond_loopback(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator",
            "serve",
            "--host",
            "0.0.0.0",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--token-file" in result.stderr


# -- the CLI client ---------------------------------------------------------------------


def client_command(service: ServiceProc, *args: str) -> dict[str, Any]:
    """What runs `coordinator ARGS` against `service`, for subprocess.run or Popen. No
    --token: the CLI finds the token the service made in its data directory."""
    env = {k: v for k, v in os.environ.items() if k != "COORDINATOR_TOKEN"}
    return {
        "args": [sys.executable, "-m", "coordinator", *args, "--server", service.url],
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "text": True,
        "env": {**env, "COORDINATOR_DATA": str(service.data)},
    }


def test_the_cli_submits_waits_and_mirrors_the_outcome(serve: Callable[..., ServiceProc]) -> None:
    service = serve()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(**client_command(service, *args), timeout=180)

    done = cli("submit", "noop", "--workers", "2", "--id", "cli-ok", "--wait")
    assert done.returncode == 0, done.stderr
    assert "cli-ok: SUCCEEDED" in done.stdout
    status = cli("status", "cli-ok")
    assert status.returncode == 0 and "every member exited 0" in status.stdout
    logs = cli("logs", "cli-ok", "--rank", "1")
    assert logs.returncode == 0 and '"phase": "cleaner"' in logs.stdout
    assert all(line.startswith("[rank 1] ") for line in logs.stdout.splitlines())
    failed = cli("submit", "noop", "--workers", "2", "--param", "colour=red")
    assert failed.returncode == 2 and "params" in failed.stderr
    listed = cli("jobs")
    assert listed.returncode == 0 and "cli-ok" in listed.stdout
    missing = cli("status", "nobody")
    assert missing.returncode == 2 and "404" in missing.stderr


def test_submit_wait_and_events_follow_a_quiet_job_past_the_keep_alives(
    serve: Callable[..., ServiceProc],
) -> None:
    """A job whose state stays put for many keep-alives of its events stream (every 0.3 s
    here, 15 s by default): `submit --wait` and `events` follow it to its end."""
    service = serve("--events-ping", "0.3")
    args = ["submit", "noop", "--workers", "1", "--id", "quiet", "--param", "seconds=3"]
    assert subprocess.run(**client_command(service, *args), timeout=60).returncode == 0
    with subprocess.Popen(**client_command(service, "events", "quiet")) as events:
        try:
            # The same submit again is the same job (idempotent), now followed to its end.
            waited = subprocess.run(**client_command(service, *args, "--wait"), timeout=60)
            assert waited.returncode == 0, waited.stderr
            assert "quiet: SUCCEEDED" in waited.stdout
            out, errors = events.communicate(timeout=30)
        finally:
            events.kill()
    assert events.returncode == 0, errors
    assert "SUCCEEDED" in out


# -- queue, deadline, metrics -------------------------------------------------------------


def test_the_queue_starts_whole_jobs_by_priority_then_arrival(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()  # 4 worker slots
    service.http.post("/v1/jobs", json={"id": "big", "kind": "noop", "workers": 4,
                                        "params": {"seconds": 4}})  # fmt: skip
    wait_state(service, "big", {"RUNNING"})
    for job_id, priority in [("low", 0), ("high", 5), ("later", 5)]:
        spec = {"id": job_id, "kind": "noop", "workers": 3, "priority": priority}
        assert service.http.post("/v1/jobs", json=spec).status_code == 201
    assert service.http.get("/v1/jobs/low").json()["state"] == "PENDING"  # no slots: it waits
    starts = {}
    for job_id in ["low", "high", "later"]:
        record = wait_state(service, job_id, {"SUCCEEDED"}, timeout=120)
        starts[job_id] = next(c["at"] for c in record["conditions"] if c["state"] == "STARTING")
    # 3 + 3 > 4 slots: one at a time, the higher priority first, then by arrival.
    assert starts["high"] < starts["later"] < starts["low"]


def test_the_deadline_fails_a_job_and_metrics_count_it(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()
    spec = {"id": "slow", "kind": "noop", "workers": 2, "params": {"seconds": 60},
            "deadline_seconds": 2}  # fmt: skip
    service.http.post("/v1/jobs", json=spec)
    record = wait_state(service, "slow", {"FAILED"}, timeout=30)
    assert record["conditions"][-1]["reason"] == "deadline of 2s passed"
    assert no_member_runs(record)
    metrics = service.http.get("/metrics").text
    assert 'coordinator_jobs{state="FAILED"} 1.0' in metrics
    assert 'coordinator_submissions_total{outcome="created"} 1.0' in metrics
    assert "coordinator_member_launches_total 2.0" in metrics
    assert service.http.get("/readyz").json() == {"status": "ready"}


@pytest.mark.slow  # ~14 s: the default suite is at its budget
def test_an_mnist_job_restarted_after_a_trainer_dies_resumes_from_its_checkpoint(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()
    spec = {"id": "digits", "kind": "mnist", "workers": 3, "max_restarts": 1,
            "params": {"epochs": 3, "checkpoint_every": 20, "eval_seconds": 3600}}  # fmt: skip
    assert service.http.post("/v1/jobs", json=spec).status_code == 201, "submit"
    running = wait_state(service, "digits", {"RUNNING"}, timeout=120)
    checkpoints = service.data / "artifacts" / "digits" / "checkpoint"
    wait_until(lambda: any(checkpoints.glob("server-*.pt")), 120, "a server checkpoint")
    trainer = next(m for m in running["attempts"][0]["members"] if m["rank"] == 2)
    os.kill(trainer["pid"], signal.SIGKILL)
    record = wait_state(service, "digits", {"SUCCEEDED", "FAILED"}, timeout=240)
    assert record["state"] == "SUCCEEDED", record["conditions"]
    assert len(record["attempts"]) == 2 and "rank 2" in record["attempts"][0]["outcome"]
    summary = json.loads((service.data / "artifacts" / "digits" / "summary.json").read_text())
    assert summary["resumed_from_version"]["0"] >= 20  # not a fresh start


def test_the_embedded_etcd_outlives_a_killed_service_and_is_found_again(tmp_path: Path) -> None:
    """Without --etcd: the service's own etcd keeps the jobs and the members' rendezvous
    while the service is SIGKILLed; the restarted service finds it and finishes the job."""
    data = tmp_path / "own"
    data.mkdir()
    services: list[ServiceProc] = []
    try:
        first = ServiceProc("", "/coordinator", data)
        services.append(first.ready())
        first.http.post("/v1/jobs", json={"id": "kept", "kind": "noop", "workers": 2,
                                          "params": {"seconds": 4}})  # fmt: skip
        wait_state(first, "kept", {"RUNNING"})
        endpoint = json.loads((data / "etcd.json").read_text())["endpoint"]
        first.kill()
        second = ServiceProc("", "/coordinator", data)
        services.append(second.ready())
        assert json.loads((data / "etcd.json").read_text())["endpoint"] == endpoint
        record = wait_state(second, "kept", {"SUCCEEDED"}, timeout=60)
        assert len(record["attempts"]) == 1
        # A clean stop with no job left running takes its etcd down (it started in the
        # first service), and the record with it.
        etcd_pid = json.loads((data / "etcd.json").read_text())["pid"]
        second.stop()
        assert second.process.returncode == 0
        assert not (data / "etcd.json").exists()
        wait_until(lambda: not psutil.pid_exists(etcd_pid), 10, "the service's etcd to end")
    finally:
        for service in services:
            service.stop()
        kill_members(data)
        state = data / "etcd.json"
        if state.exists():  # the service leaves it up while jobs run: stop it here
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(json.loads(state.read_text())["pid"]).kill()
