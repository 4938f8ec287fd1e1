"""The compose files with real containers: the whole product (etcd, the REST service and
agents; compose/compose.yaml) and the one-job mode (etcd plus worker containers that
rendezvous; compose/job.yaml)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import xgboost
from docker.models.containers import Container

from coordinator.etcd.client import Etcd
from coordinator.ps.model import MnistNet
from coordinator.rendezvous.errors import MemberLost
from tests.conftest import wait_until
from tests.containers.harness import (
    COMPOSE_FILE,
    JOB_COMPOSE_FILE,
    LABEL,
    Images,
    PodmanService,
    compose,
)

pytestmark = pytest.mark.containers

TTL = 2


@pytest.fixture
def project(podman_service: PodmanService) -> Iterator[str]:
    """A compose project name of the test's own; everything in it is removed afterwards."""
    name = f"ectest{uuid.uuid4().hex[:8]}"
    yield name
    for file in (COMPOSE_FILE, JOB_COMPOSE_FILE):  # whichever mode the test brought up
        compose(name, "down", "-v", "--remove-orphans", "-t", "1", env={}, file=file)
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
    result = compose(project, "up", "-d", env=env, file=JOB_COMPOSE_FILE)
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
    result = compose(project, "up", "-d", env=env, file=JOB_COMPOSE_FILE)
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
    result = compose(project, "up", "-d", env=env, file=JOB_COMPOSE_FILE)
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


# -- least privilege ------------------------------------------------------------------

COORDINATOR_USER = "10001:10001"  # the image's user, also set in the compose files
ETCD_USER = "65532:65532"  # distroless's `nonroot`, owner of /home/nonroot (etcd's data)


def _proc_status(pid: int) -> dict[str, str]:
    """The kernel's view of a container's main process (rootful podman: a host pid)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def assert_least_privilege(container: Container, user: str) -> None:
    """What the compose files ask for, as the engine reports it and as the kernel applies
    it to the running process: a non-root user, a read-only root filesystem, no
    capability at all, no-new-privileges."""
    container.reload()
    host, config = container.attrs["HostConfig"], container.attrs["Config"]
    name = container.name
    assert config["User"] == user, name
    assert host["ReadonlyRootfs"] is True, name
    assert not host.get("CapAdd"), name
    # Docker reports ["ALL"]; podman the default set it dropped, name by name.
    dropped = {cap.removeprefix("CAP_") for cap in host["CapDrop"] or []}
    assert "ALL" in dropped or {"CHOWN", "DAC_OVERRIDE", "SETUID", "SETGID"} <= dropped, name
    assert any(opt.startswith("no-new-privileges") for opt in host["SecurityOpt"] or []), name
    status = _proc_status(container.attrs["State"]["Pid"])
    uid, gid = user.split(":")
    assert status["Uid"].split() == [uid] * 4 and status["Gid"].split() == [gid] * 4, name
    for capabilities in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[capabilities], 16) == 0, f"{name}: {capabilities} {status[capabilities]}"
    assert status["NoNewPrivs"] == "1", name


def assert_writes_only_where_allowed(container: Container, writable: list[str]) -> None:
    """The root filesystem refuses a write; each of `writable` takes one (as uid 10001)."""
    code, output = container.exec_run(["sh", "-c", "touch /probe"])
    assert code != 0 and b"Read-only file system" in output, (container.name, output)
    for folder in writable:
        probe = f"{folder}/probe-{uuid.uuid4().hex[:6]}"
        code, output = container.exec_run(["sh", "-c", f"touch {probe} && rm {probe}"])
        assert code == 0, (container.name, folder, output)


def test_one_job_mode_runs_with_least_privilege(
    podman_service: PodmanService, images: Images, project: str
) -> None:
    """compose/job.yaml: etcd and the workers as non-root users without capabilities, on
    read-only root filesystems; the workers write /tmp and the artifacts volume only."""
    env = compose_env(images, "compose-privilege", WORKERS="2", COORDINATOR_PARAMS="seconds=30")
    env["COORDINATOR_WORLD_SIZE"] = "2"
    result = compose(project, "up", "-d", env=env, file=JOB_COMPOSE_FILE)
    assert result.returncode == 0, result.stderr
    workers = service_containers(podman_service, project, "worker")
    wait_until(lambda: past_connect_or_exited(workers), 120, "the two workers past connect")
    assert not any(w.status == "exited" for w in workers), [w.logs()[-500:] for w in workers]
    (etcd,) = service_containers(podman_service, project, "etcd")
    assert_least_privilege(etcd, ETCD_USER)
    for worker in workers:
        assert_least_privilege(worker, COORDINATOR_USER)
        assert_writes_only_where_allowed(worker, ["/tmp", "/artifacts"])


# -- the whole product: etcd, the REST service, agents -----------------------------------

AGENTS = 3


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _agents_registered(podman: PodmanService, project: str) -> int:
    with etcd_client(podman, project) as etcd:
        return etcd.count_prefix(etcd.key("agents") + "/")


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.timeout(900)
def test_compose_product_runs_a_job_submitted_over_rest_on_the_agents(
    podman_service: PodmanService, images: Images, project: str, tmp_path: Path
) -> None:
    """`up` with the service and 3 agents; `coordinator submit xgboost --workers 3` from
    the host reaches the API on a published loopback port and the job succeeds on the
    agents; the model is in the artifacts volume; every container runs with least
    privilege; `down -v` leaves no container, network or volume of the project."""
    submit_token, read_token = f"s-{uuid.uuid4().hex}", f"r-{uuid.uuid4().hex}"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# test tokens\nsubmit {submit_token}\nread {read_token}\n")
    tokens.chmod(0o644)  # the service (uid 10001) reads it; see docs/compose.md
    port = _free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "ETCD_IMAGE": images.etcd,
        "COORDINATOR_IMAGE": images.worker,
        "TOKEN_FILE": str(tokens),
        "PORT": str(port),
        "HOST_IP": "127.0.0.1",  # the default, said here: test traffic stays on loopback
        "AGENTS": str(AGENTS),
        "SLOTS": "2",
    }
    result = compose(project, "up", "-d", env=env, file=COMPOSE_FILE)
    assert result.returncode == 0, result.stderr

    (etcd,) = service_containers(podman_service, project, "etcd")
    (service,) = service_containers(podman_service, project, "service")
    agents = service_containers(podman_service, project, "agent")
    assert len(agents) == AGENTS

    def diagnostics() -> str:
        return "\n".join(
            f"--- {c.name}\n{c.logs(tail=40).decode(errors='replace')}" for c in (service, *agents)
        )

    wait_until(lambda: _ready(url), 120, f"the service ready at {url}\n{diagnostics()}")
    wait_until(
        lambda: _agents_registered(podman_service, project) == AGENTS,
        60,
        f"{AGENTS} agents registered\n{diagnostics()}",
    )

    assert_least_privilege(etcd, ETCD_USER)
    for container in (service, *agents):
        assert_least_privilege(container, COORDINATOR_USER)
        assert_writes_only_where_allowed(container, ["/tmp", "/data", "/artifacts"])
    assert httpx.get(f"{url}/v1/jobs", timeout=5).status_code == 401, "a token is required"

    job = f"product-{uuid.uuid4().hex[:6]}"
    params = "rounds=5,data=synthetic:20000x8:1,eval_data=synthetic:5000x8:2"
    submit = subprocess.run(
        [sys.executable, "-m", "coordinator", "submit", "xgboost", "--workers", "3",
         "--param", params, "--id", job, "--server", f"http://localhost:{port}",
         "--token", submit_token, "--wait"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_COLOR": "1"},
    )  # fmt: skip
    headers = {"Authorization": f"Bearer {read_token}"}
    response = httpx.get(f"{url}/v1/jobs/{job}", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    record = response.json()
    assert submit.returncode == 0, (
        f"{submit.stdout[-2000:]}\n{submit.stderr[-2000:]}\n{json.dumps(record)[:3000]}\n"
        + diagnostics()
    )
    assert record["state"] == "SUCCEEDED"

    # Run by the agents, not by the service: every member assigned to one of them.
    assert record["spec"]["launcher"] == "agents"
    agent_ids = {a.attrs["Config"]["Hostname"] for a in agents}
    members = record["attempts"][-1]["members"]
    assert len(members) == 3
    assert all(m["assignment"].split("/")[0] in agent_ids for m in members), members
    # Their output reaches the host through the service, from whichever agent ran them.
    logs = httpx.get(f"{url}/v1/jobs/{job}/logs", params={"rank": 0}, headers=headers, timeout=30)

    # The model, in the artifacts volume.
    volume = podman_service.client.volumes.get(f"{project}_artifacts")
    model = Path(volume.attrs["Mountpoint"]) / job / "model.json"
    assert model.exists() and model.stat().st_size > 0
    xgboost.Booster(model_file=str(model))  # a model xgboost reads back

    result = compose(project, "down", "-v", "-t", "10", env=env, file=COMPOSE_FILE)
    assert result.returncode == 0, result.stderr
    client = podman_service.client
    label = f"com.docker.compose.project={project}"
    assert client.containers.list(all=True, filters={"label": label}) == []
    assert [n.name for n in client.networks.list() if n.name.startswith(project)] == []
    assert [v.name for v in client.volumes.list() if v.name.startswith(project)] == []

    assert logs.status_code == 200 and "[rank 0]" in logs.text, logs.text[-2000:]
    assert record["artifacts"]["model_path"] == f"/artifacts/{job}/model.json"
