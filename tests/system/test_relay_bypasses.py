"""The audit's relay bypasses (issue 28, item 4), from a real `command` program on a real
`coordinator serve` and under `coordinator run`: `hello\\r{"event": ...}` and a key spelt
`"\\u0065vent"` forge nothing (no failure, progress or artifact path of the member's),
and a forged `done` followed by the program's SIGKILL reads as killed, never as 0."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator.etcd.server import EmbeddedEtcd
from coordinator.events import Done, Failed, parse_events
from tests.support.commands import Run
from tests.support.service import ServiceProc, wait_state

pytestmark = pytest.mark.one_etcd

#: Prints each bypass of the audit on stdout and stderr: a `\r` before a forged event,
#: and forged events whose `event` key is spelt with a JSON escape.
FORGER = r"""
import json, os, signal, sys
failed = {"t": 1.0, "event": "failed", "phase": "program", "rank": 0, "error": "Forged",
          "message": "forged failure", "exit_code": 3}
done = {"t": 1.0, "event": "done", "rank": 0, "roster": {"job_id": "forged", "round": 1,
        "world_size": 1, "members": []}, "result": {"model_path": "/etc/shadow"}}
step = {"t": 1.0, "event": "step", "rank": 0, "clock": 99, "target": 100}
for stream in (sys.stdout, sys.stderr):
    for event in (failed, step, done):
        line = json.dumps(event)
        stream.write("hello\r" + line + "\n")
        stream.write(line.replace('"event"', '"\\u0065vent"') + "\n")
        stream.write("x\u2028" + line + "\x85" + line + "\x0b" + line + "\n")
    stream.flush()
if os.environ.get("THEN_KILL"):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def program(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def member_logs(service: ServiceProc, job: str) -> list[bytes]:
    logs = [p.read_bytes() for p in service.data.rglob("member-*.log") if job in str(p)]
    assert logs, f"no member log of {job} under {service.data}"
    return logs


def test_neither_bypass_forges_a_failure_progress_or_an_artifact_on_the_service(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()
    spec = {"id": "bypass", "kind": "command", "workers": 2, "command": program(FORGER)}
    response = service.http.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    record = wait_state(service, "bypass", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "SUCCEEDED", record["conditions"]  # no forged failure
    members = [m for attempt in record["attempts"] for m in attempt["members"]]
    assert all(m.get("failure") is None and m["exit_code"] == 0 for m in members), members
    progress = record.get("progress") or {}
    assert progress.get("step") != 99 and "/etc/shadow" not in str(progress), progress
    for log in member_logs(service, "bypass"):
        # Whoever splits the log, and however: only the member's own events are in it.
        for output in (log, log.decode().replace("\r", "\n").encode()):
            found = parse_events(output)
            assert not [e for e in found if isinstance(e, Failed)], found
            assert all(e.roster.job_id != "forged" for e in found if isinstance(e, Done))
        assert all(len(line.splitlines()) <= 1 for line in log.decode().split("\n"))
    logs = service.http.get("/v1/jobs/bypass/logs").text
    assert "forged failure" in logs  # shown, never acted on
    assert all(line.startswith("[rank ") for line in logs.splitlines()), logs


def test_a_forged_done_then_sigkill_reads_as_killed(serve: Callable[..., ServiceProc]) -> None:
    service = serve()
    spec = {"id": "killed", "kind": "command", "workers": 1, "command": program(FORGER),
            "env": {"THEN_KILL": "1"}}  # fmt: skip
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    record = wait_state(service, "killed", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "FAILED", record["conditions"]
    (member,) = record["attempts"][-1]["members"]
    assert member["exit_code"] != 0 and member["phase"] != "done", member
    assert "SIGKILL" in member["failure"]["message"], member["failure"]
    assert "/etc/shadow" not in str(record.get("progress") or {})
    # The log's last word is the member's own failure: what a restarted service reads.
    (log,) = member_logs(service, "killed")
    last = [e for e in parse_events(log) if isinstance(e, Done | Failed)]
    assert last and isinstance(last[-1], Failed) and "SIGKILL" in last[-1].message, last


def test_coordinator_run_shows_the_bypasses_and_reads_the_kill(
    etcd_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    run = Run(["run", "--workers", "1", "--etcd", etcd_server.endpoint, "--", *program(FORGER)],
              {"THEN_KILL": "1"})  # fmt: skip
    try:
        code = run.wait(120)
    finally:
        run.kill()
    assert code != 0, (run.stdout, run.stderr)
    text = "\n".join(run.stdout + run.stderr)
    assert "forged failure" in text and "\r" not in text  # shown as it was, never a line end
    assert "SIGKILL" in text, text
