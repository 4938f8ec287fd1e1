"""The compose cluster with real containers: etcd plus worker containers that rendezvous."""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import xgboost
from docker.models.containers import Container

from coordinator.etcd.client import Etcd
from coordinator.ps.model import MnistNet
from coordinator.rendezvous.errors import MemberLost
from tests.conftest import wait_until
from tests.containers.harness import LABEL, Images, PodmanService, compose

pytestmark = pytest.mark.containers

TTL = 2


@pytest.fixture
def project(podman_service: PodmanService) -> Iterator[str]:
    """A compose project name of the test's own; everything in it is removed afterwards."""
    name = f"ectest{uuid.uuid4().hex[:8]}"
    yield name
    compose(name, "down", "-v", "--remove-orphans", "-t", "1", env={})
    client = podman_service.client
    project_label = f"com.docker.compose.project={name}"
    for container in client.containers.list(all=True, filters={"label": project_label}):
        container.remove(force=True, v=True)
    for network in client.networks.list(filters={"label": project_label}):
        network.remove()
    for volume in client.volumes.list(filters={"label": project_label}):
        volume.remove(force=True)


def compose_env(images: Images, job: str, **extra: str) -> dict[str, str]:
    return {
        "ETCD_IMAGE": images.etcd,
        "COORDINATOR_IMAGE": images.worker,
        "COORDINATOR_JOB": job,
        **extra,
    }


def service_containers(podman: PodmanService, project: str, service: str) -> list[Container]:
    labels = [f"com.docker.compose.project={project}", f"com.docker.compose.service={service}"]
    return podman.client.containers.list(all=True, filters={"label": labels})


def events(container: Container) -> list[dict[str, Any]]:
    lines = container.logs(stdout=True, stderr=False).decode().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def address_on(container: Container, network: str) -> str:
    container.reload()
    return container.attrs["NetworkSettings"]["Networks"][network]["IPAddress"]


def etcd_client(podman: PodmanService, project: str) -> Etcd:
    """The host reaches container addresses on the project's network directly."""
    (etcd,) = service_containers(podman, project, "etcd")
    return Etcd(f"{address_on(etcd, f'{project}_default')}:2379", connect_timeout=20)


def past_connect_or_exited(containers: list[Container]) -> bool:
    """All have passed `connect`, or one has exited (the test then reports why)."""
    if any(c.status == "exited" for c in containers if c.reload() is None):
        return True
    return all(any(e.get("phase") == "connect" for e in events(c)) for c in containers)


def exited(containers: list[Container]) -> bool:
    for container in containers:
        container.reload()
    return all(c.status == "exited" for c in containers)


@pytest.mark.timeout(1800)
def test_the_worker_image_has_pytorch_for_cpu(
    podman_service: PodmanService, images: Images
) -> None:
    """First in this module, so the worker image is built here, under a timeout of its
    own: from nothing, debootstrap and the image with PyTorch take about 9 minutes."""
    size = podman_service.client.images.get(images.worker).attrs["Size"]
    assert size < 2e9, f"{size / 1e9:.2f} GB: CUDA packages in the image?"
    script = (
        "import importlib.metadata as m, torch, mlxtend; "
        "print(torch.__version__, torch.version.cuda, "
        "[d.name for d in m.distributions() if d.name.startswith('nvidia')])"
    )
    output = podman_service.client.containers.run(
        images.worker, ["-c", script], entrypoint="python3", remove=True, labels={LABEL: "1"}
    )
    assert output.decode().split() == ["2.13.0+cpu", "None", "[]"]


def test_compose_cluster_rendezvous(
    podman_service: PodmanService, images: Images, project: str
) -> None:
    """`up` brings etcd and 3 workers; each detects its own address, all pass every phase."""
    job = "compose-test"
    # The workers hold for a while after `connect`, so their addresses can be read
    # while they run (an exited container no longer has one).
    env = compose_env(images, job, WORKERS="3", COORDINATOR_PARAMS="seconds=8")
    result = compose(project, "up", "-d", env=env)
    assert result.returncode == 0, result.stderr
    workers = service_containers(podman_service, project, "worker")
    assert len(workers) == 3
    wait_until(lambda: past_connect_or_exited(workers), 120, "the three workers past connect")
    network = f"{project}_default"
    assert not any(w.status == "exited" for w in workers), [w.logs()[-500:] for w in workers]
    own_address = {w.id: address_on(w, network) for w in workers}
    assert len(set(own_address.values())) == 3, "each container has its own address"
    wait_until(lambda: exited(workers), 60, "the three workers to finish")

    rosters = []
    for worker in workers:
        assert worker.attrs["State"]["ExitCode"] == 0, worker.logs().decode()[-2000:]
        done = next(e for e in events(worker) if e["event"] == "done")
        mine = done["roster"]["members"][done["rank"]]
        assert mine["host"] == own_address[worker.id], "detected its own container address"
        rosters.append(done["roster"])
    assert all(r == rosters[0] for r in rosters)
    assert {m["host"] for m in rosters[0]["members"]} == set(own_address.values())

    with etcd_client(podman_service, project) as etcd:
        assert etcd.count_prefix(etcd.key("jobs", job) + "/") == 0


def train_three(
    podman_service: PodmanService, project: str, env: dict[str, str]
) -> dict[int, dict[str, Any]]:
    """Bring up 3 workers, wait until they all exit 0; their results by rank."""
    result = compose(project, "up", "-d", env=env)
    assert result.returncode == 0, result.stderr
    workers = service_containers(podman_service, project, "worker")
    assert len(workers) == 3
    wait_until(lambda: exited(workers), 240, "the three workers to train and finish")
    results = {}
    for worker in workers:
        assert worker.attrs["State"]["ExitCode"] == 0, worker.logs().decode()[-2000:]
        done = next(e for e in events(worker) if e["event"] == "done")
        results[done["rank"]] = done["result"]
    assert sorted(results) == [0, 1, 2]
    return results


def test_compose_cluster_trains_xgboost_and_saves_the_model_in_the_artifacts_volume(
    podman_service: PodmanService, images: Images, project: str
) -> None:
    """The documented XGBoost run: 3 worker containers, the tracker on the leader's
    container address, one model file in the `artifacts` volume."""
    job = "compose-xgb"
    params = "rounds=5,data=synthetic:20000x8:1,eval_data=synthetic:5000x8:2"
    env = compose_env(
        images, job, WORKERS="3", COORDINATOR_KIND="xgboost", COORDINATOR_PARAMS=params
    )
    results = train_three(podman_service, project, env)
    assert len({r["model_sha256"] for r in results.values()}) == 1
    assert results[0]["model_path"] == f"/artifacts/{job}/model.json"
    volume = podman_service.client.volumes.get(f"{project}_artifacts")
    model = Path(volume.attrs["Mountpoint"]) / job / "model.json"
    assert model.exists() and model.stat().st_size > 0
    assert (
        hashlib.sha256(xgboost.Booster(model_file=str(model)).save_raw("ubj")).hexdigest()
        == results[0]["model_sha256"]
    )


def test_compose_cluster_trains_mnist_with_a_parameter_server_and_saves_the_model(
    podman_service: PodmanService, images: Images, project: str
) -> None:
    """The documented MNIST run: 3 worker containers (rank 0 the parameter server, two
    trainers) on the builtin digits; model.pt and summary.json in the `artifacts` volume."""
    job = "compose-mnist"
    env = compose_env(
        images, job, WORKERS="3", COORDINATOR_KIND="mnist", COORDINATOR_PARAMS="epochs=2"
    )
    results = train_three(podman_service, project, env)
    assert results[0]["model_path"] == f"/artifacts/{job}/model.pt"
    assert [results[rank]["role"] for rank in (1, 2)] == ["trainer", "trainer"]
    folder = Path(podman_service.client.volumes.get(f"{project}_artifacts").attrs["Mountpoint"])
    summary = json.loads((folder / job / "summary.json").read_text())
    assert (summary["servers"], summary["trainers"]) == (1, 2)
    # The builtin digits reach about 0.94 after 2 epochs.
    assert 0.8 < summary["test_accuracy"] <= 1
    assert summary["test_accuracy"] == results[0]["metrics"]["test_accuracy"]
    MnistNet().load_state_dict(torch.load(folder / job / "model.pt", weights_only=True))


def test_killed_worker_container_fails_the_others_fast(
    podman_service: PodmanService, images: Images, project: str
) -> None:
    """Two compose workers wait at the training barrier while a third is still
    training; `podman kill` of the third makes both exit with MemberLost within TTL + 2 s."""
    job = "compose-kill"
    env = compose_env(
        images, job, WORKERS="2", COORDINATOR_WORLD_SIZE="3", COORDINATOR_TTL=str(TTL)
    )
    result = compose(project, "up", "-d", env=env)
    assert result.returncode == 0, result.stderr
    network = f"{project}_default"
    slow = podman_service.client.containers.run(
        images.worker,
        ["worker"],
        detach=True,
        network=network,
        labels={LABEL: "1"},
        environment={
            "COORDINATOR_ETCD": "etcd:2379",
            "COORDINATOR_JOB": job,
            "COORDINATOR_WORLD_SIZE": "3",
            "COORDINATOR_TTL": str(TTL),
            "COORDINATOR_PARAMS": "seconds=600",  # still "training" when it is killed
        },
    )
    workers = service_containers(podman_service, project, "worker")
    everyone = [*workers, slow]
    wait_until(lambda: past_connect_or_exited(everyone), 120, "all three members past connect")
    assert not any(c.status == "exited" for c in everyone), [c.logs()[-500:] for c in everyone]
    killed_at = time.time()
    slow.kill()
    wait_until(lambda: exited(workers), TTL + 30, "the two others to exit")
    slow.reload()
    slow_rank = next(e["rank"] for e in events(slow) if e.get("phase") == "connect")
    for worker in workers:
        state = worker.attrs["State"]
        assert state["ExitCode"] == MemberLost.exit_code, worker.logs().decode()[-2000:]
        noticed = _timestamp(state["FinishedAt"]) - killed_at
        assert noticed <= TTL + 2, f"exited {noticed:.2f}s after the kill"
        logs = worker.logs().decode()
        assert f"member rank {slow_rank} was lost during phase 'training'" in logs
    slow.remove(force=True)


def _timestamp(text: str) -> float:
    """An engine's RFC 3339 time (nanoseconds, `Z` or an offset) as a Unix timestamp."""
    match = re.fullmatch(r"([0-9-]+T[0-9:]+)(\.[0-9]+)?(Z|[+-][0-9:]+)", text.strip())
    assert match, f"unexpected time format {text!r}"
    zone = "+00:00" if match[3] == "Z" else match[3]
    return datetime.fromisoformat(match[1] + (match[2] or "")[:7] + zone).timestamp()
