"""Bounded members on a real `coordinator serve` (issue 28, item 4): a thread count above
the cap is refused at submit, naming the field and the cap, and by `coordinator run`; a
`command` program that starts 10,000 threads is contained by its member's pids cgroup
while the service stays ready and another job runs; its cgroup goes when it ends. An
agent's members are bounded the same way."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.etcd.client import Etcd
from coordinator.launch.pids import InCgroup, MemberCgroups, local_plan
from tests.support.agents import registered
from tests.support.service import ServiceProc, wait_state
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd

# Starts threads until refused (or 10,000), says how many, and holds them until the test
# lets go (a file appears; 60 s at most): contained, it fails with code 3.
BOMB = """
import os, sys, threading, time
from pathlib import Path
release = Path(sys.argv[1])
cgroup = [l for l in Path('/proc/self/cgroup').read_text().splitlines() if ':pids:' in l]
print('cgroup', cgroup, flush=True)
hold = threading.Event()
started = 0
try:
    while started < 10_000:
        threading.Thread(target=hold.wait, daemon=True).start()
        started += 1
except RuntimeError:
    pass
print('started', started, 'threads', flush=True)
deadline = time.monotonic() + 60
while not release.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
hold.set()
sys.exit(0 if started == 10_000 else 3)
"""


def bounded_here() -> InCgroup:
    plan = local_plan(limit=64)
    if not isinstance(plan, InCgroup):
        pytest.skip(f"no pids cgroup is ours here: {plan}")
    return plan


def logs(service: ServiceProc, job_id: str) -> str:
    return service.http.get(f"/v1/jobs/{job_id}/logs").text


@pytest.mark.parametrize(("kind", "name"), [("mnist", "threads"), ("xgboost", "nthread")])
def test_a_million_threads_is_refused_at_submit_naming_the_field_and_the_cap(
    serve: Callable[..., ServiceProc], kind: str, name: str
) -> None:
    service = serve("--max-threads", "3")
    for value in ("1000000", "4"):
        spec = {"kind": kind, "workers": 1, "params": {name: value}}
        response = service.http.post("/v1/jobs", json=spec)
        assert response.status_code == 422, response.text
        [error] = response.json()["detail"]
        assert error["loc"] == ["body", "params", name]
        assert f"{name}={value}" in error["msg"] and "cap of 3" in error["msg"]
    assert service.http.get("/v1/jobs").json()["jobs"] == []  # nothing was stored


def test_coordinator_run_refuses_a_thread_count_above_the_cap(tmp_path: Path) -> None:
    ran = subprocess.run(
        [sys.executable, "-m", "coordinator", "run", "xgboost", "--workers", "1",
         "--param", "nthread=1000000"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**__import__("os").environ, "COORDINATOR_MAX_THREADS": "2", "COLUMNS": "200"},
    )  # fmt: skip
    assert ran.returncode == 2, ran.stderr
    assert "--param" in ran.stderr and "nthread=1000000" in ran.stderr, ran.stderr
    assert "cap of 2" in ran.stderr, ran.stderr


def test_a_thread_bomb_is_contained_and_the_service_stays_ready(
    serve: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    bounded_here()
    service = serve("--member-pids-limit", "64")
    release = tmp_path / "release"
    spec = {"id": "bomb", "kind": "command", "workers": 1,
            "command": [sys.executable, "-c", BOMB, str(release)]}  # fmt: skip
    assert service.http.post("/v1/jobs", json=spec).status_code == 201, spec
    held = wait_until(lambda: "threads" in logs(service, "bomb"), 60, "the bomb to be stopped")
    assert held
    text = logs(service, "bomb")
    started = int(text.split("started ")[1].split()[0])
    assert started < 64, text  # the member, its relay and the program share the 64
    assert "/coordinator-" in text and "/bomb-" in text, text  # in its member's own cgroup

    assert service.http.get("/readyz").status_code == 200  # while it holds every pid it may
    other = {"id": "other", "kind": "noop", "workers": 2, "params": {"seconds": "0"}}
    assert service.http.post("/v1/jobs", json=other).status_code == 201
    assert wait_state(service, "other", {"SUCCEEDED", "FAILED"})["state"] == "SUCCEEDED"

    release.touch()
    record = wait_state(service, "bomb", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "FAILED", record["conditions"]
    # The program, or its member that shares the limit, ran out: either way rank 0 failed.
    assert "rank 0" in record["conditions"][-1]["reason"], record["conditions"]
    base = MemberCgroups(bounded_here(), service.data / "logs").base
    wait_until(lambda: not base.exists(), 30, "the members' cgroups to go")
    assert service.http.get("/readyz").status_code == 200


def test_an_agent_s_members_run_in_a_pids_cgroup_of_their_own(
    serve: Callable[..., ServiceProc], agents: Any, etcd: Etcd, tmp_path: Path
) -> None:
    bounded_here()
    agent = agents("--id", "bounded", "--slots", "1", "--member-pids-limit", "48")
    wait_until(lambda: registered(etcd, "bounded"), 30, "the agent to register")
    service = serve("--default-launcher", "agents")
    show = (
        "from pathlib import Path; import re; "
        "line = re.search(r':pids:(.*)', Path('/proc/self/cgroup').read_text())[1]; "
        "print('limit', Path('/sys/fs/cgroup/pids' + line, 'pids.max').read_text().strip(), line)"
    )
    spec = {"id": "onagent", "kind": "command", "workers": 1,
            "command": [sys.executable, "-c", show]}  # fmt: skip
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    record = wait_state(service, "onagent", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "SUCCEEDED", record["conditions"]
    text = logs(service, "onagent")
    assert "limit 48 /coordinator-" in text, text
    base = MemberCgroups(bounded_here(), tmp_path / "a0" / "logs").base
    wait_until(lambda: not base.exists(), 30, "the member's cgroup to go")
    assert agent.process.poll() is None


def test_an_agent_s_own_thread_cap_fails_a_job_the_service_let_through(
    serve: Callable[..., ServiceProc], agents: Any, etcd: Etcd
) -> None:
    """The service caps at its host's count; an agent on a smaller host caps lower, and its
    member refuses the job before it joins, naming the parameter and the agent's cap."""
    agents("--id", "small", "--slots", "1", "--max-threads", "1")
    wait_until(lambda: registered(etcd, "small"), 30, "the agent to register")
    service = serve("--default-launcher", "agents", "--max-threads", "2")
    spec = {"id": "twothreads", "kind": "xgboost", "workers": 1, "params": {"nthread": "2"}}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    record = wait_state(service, "twothreads", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "FAILED"
    reason = record["conditions"][-1]["reason"]
    assert "nthread=2" in reason and "cap of 1" in reason, reason
