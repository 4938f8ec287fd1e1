"""GPUs on agents, end to end: real agents declaring GPU ids, a real `coordinator serve`
placing a `command` job's members on whole GPUs, real programs reporting what they see.
No GPU is needed: the declared ids are the truth, and the program only reads its env."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

from coordinator.etcd.client import Etcd
from tests.support.agents import registered
from tests.support.service import ServiceProc, wait_state
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd
SHOW = (
    "import os; print('gpu-check', os.environ['RANK'], os.getcwd(), "
    "os.environ['CUDA_VISIBLE_DEVICES'])"
)


def test_four_members_on_two_agents_with_two_gpus_each_get_distinct_gpus_per_host(
    serve: Callable[..., ServiceProc],
    agents: Any,
    etcd: Etcd,
) -> None:
    started = [agents("--id", f"gpu-{n}", "--slots", "4", "--gpus", "0,1") for n in range(2)]
    for n in range(2):
        record = wait_until(lambda n=n: registered(etcd, f"gpu-{n}"), 30, "agents to register")
        assert record["gpus"] == [0, 1]
    service = serve("--default-launcher", "agents")
    spec = {"id": "gpus", "kind": "command", "workers": 4, "gpus_per_worker": 1,
            "command": [sys.executable, "-c", SHOW]}  # fmt: skip
    response = service.http.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text

    record = wait_state(service, "gpus", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "SUCCEEDED", record["conditions"]
    logs = service.http.get("/v1/jobs/gpus/logs").text
    seen: dict[str, list[str]] = {}  # the agent's folder (its host) -> the GPUs its members saw
    ranks = set()
    for line in logs.splitlines():
        if "gpu-check" in line:
            rank, folder, visible = line.split("gpu-check", 1)[1].split()
            ranks.add(rank)
            seen.setdefault(folder, []).append(visible)
    assert ranks == {"0", "1", "2", "3"}, logs
    assert len(seen) == 2, seen  # two members on each agent
    for visible in seen.values():
        assert sorted(visible) == ["0", "1"], seen  # distinct, whole GPUs on each host

    # More GPUs per member than any agent has: refused, naming the field and the GPUs.
    too_many = {**spec, "id": "greedy", "workers": 1, "gpus_per_worker": 3}
    refused = service.http.post("/v1/jobs", json=too_many)
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"][0]
    assert detail["loc"][-1] == "gpus_per_worker" and "4 GPUs" in detail["msg"], detail
    local = service.http.post("/v1/jobs", json={**spec, "id": "here", "launcher": "local"})
    assert local.status_code == 422 and local.json()["detail"][0]["loc"][-1] == "launcher"
    assert all(agent.process.poll() is None for agent in started)


def test_an_agent_refuses_bad_gpu_ids(agents: Any) -> None:
    agent = agents("--id", "bad-gpus", "--gpus", "0,0")
    assert agent.process.wait(30) == 2
    assert b"more than once" in agent.process.communicate()[1]


def test_local_members_get_the_services_own_gpus_one_holder_each(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve("--gpus", "4,7")
    spec = {"id": "local-gpus", "kind": "command", "workers": 2, "gpus_per_worker": 1,
            "launcher": "local", "command": [sys.executable, "-c", SHOW]}  # fmt: skip
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    record = wait_state(service, "local-gpus", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "SUCCEEDED", record["conditions"]
    logs = service.http.get("/v1/jobs/local-gpus/logs").text
    visible = sorted(line.split()[-1] for line in logs.splitlines() if "gpu-check" in line)
    assert visible == ["4", "7"], logs
    refused = service.http.post("/v1/jobs", json={**spec, "id": "more", "workers": 3})
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"][0]["loc"][-1] == "gpus_per_worker"
