"""An unmodified DDP script (examples/ddp_mnist.py) as a REST `command` job, on the local
launcher and on a real `coordinator agent`: every rank trains and its all_reduce sums
right, and the two runs' losses are equal (same seeds, same shards).

Slow (three PyTorch imports per job, twice): CI runs it after the default suite.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.etcd.client import Etcd
from tests.support.agents import registered
from tests.support.service import ServiceProc, wait_state
from tests.support.wait import wait_until

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.one_etcd]
DDP = [sys.executable, str(Path(__file__).resolve().parents[2] / "examples" / "ddp_mnist.py")]


def results(service: ServiceProc, job: str) -> dict[int, dict[str, Any]]:
    """Each rank's closing JSON line of the example, from the job's logs."""
    found: dict[int, dict[str, Any]] = {}
    for line in service.http.get(f"/v1/jobs/{job}/logs").text.splitlines():
        _, _, text = line.partition("] ")
        if text.startswith('{"rank"'):
            result = json.loads(text)
            found[result["rank"]] = result
    return found


def test_the_ddp_example_trains_through_the_service_locally_and_on_an_agent(
    serve: Callable[..., ServiceProc],
    agents: Any,
    etcd: Etcd,
) -> None:
    agents("--id", "ddp-host", "--slots", "3")
    wait_until(lambda: registered(etcd, "ddp-host"), 30, "the agent to register")
    service = serve()
    losses = []
    for launcher in ("local", "agents"):
        job = f"ddp-{launcher}"
        spec = {"id": job, "kind": "command", "workers": 3, "launcher": launcher,
                "command": [*DDP, "--steps", "4"]}  # fmt: skip
        response = service.http.post("/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        record = wait_state(service, job, {"SUCCEEDED", "FAILED"}, timeout=180)
        assert record["state"] == "SUCCEEDED", record["conditions"]
        ranks = results(service, job)
        assert sorted(ranks) == [0, 1, 2], ranks
        assert all(r["ok"] and r["all_reduce"] == 6.0 for r in ranks.values()), ranks
        losses.append([ranks[rank]["losses"] for rank in range(3)])
    assert losses[0] == losses[1]
    assert len({tuple(rank) for rank in losses[0]}) == 3  # each rank its own shard
