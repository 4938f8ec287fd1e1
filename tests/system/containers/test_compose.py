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
from coordinator.etcd.errors import EtcdError, EtcdRefused
from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.users import agent_user, job_user, users
from coordinator.ps.model import MnistNet
from coordinator.rendezvous.errors import MemberLost
from tests.support.containers import (
    CLIENT_CERTS_FILE,
    COMPOSE_FILE,
    COORDINATOR_USER,
    DDP_COMPOSE_FILE,
    ETCD_USER,
    JOB_COMPOSE_FILE,
    LABEL,
    PLAIN_COMPOSE_FILE,
    Images,
    PodmanService,
    assert_least_privilege,
    assert_writes_only_where_allowed,
    compose,
    init_secrets,
)
from tests.support.wait import wait_until

# Real containers, and the images they need built: with the slow tests (the budget).
pytestmark = [pytest.mark.containers, pytest.mark.slow]

TTL = 2


@pytest.fixture
def project(podman_service: PodmanService) -> Iterator[str]:
    """A compose project name of the test's own; everything in it is removed afterwards."""
    name = f"ectest{uuid.uuid4().hex[:8]}"
    yield name
    for file in (COMPOSE_FILE, PLAIN_COMPOSE_FILE, JOB_COMPOSE_FILE, DDP_COMPOSE_FILE):
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


@pytest.mark.slow  # ~150 s: builds the worker image with torch (the compose DDP test reuses it)
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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compose_runs_the_ddp_example_unchanged_on_three_containers_through_secure_etcd(
    podman_service: PodmanService, images: Images, project: str, tmp_path: Path
) -> None:
    """compose/ddp.yaml: examples/ddp_mnist.py as each of 3 members' program
    (`coordinator worker --kind command -- python3 ...`), rendezvous through etcd with
    TLS and auth as the job's own user; every rank exits 0 and the all_reduce sums
    1 + 2 + 3; the members run with least privilege and no secret in their config."""
    secrets = init_secrets(tmp_path / "secrets", agents=1)
    env = {
        "ETCD_IMAGE": images.etcd,
        "COORDINATOR_IMAGE": images.worker,  # built with EXTRAS=mnist: PyTorch
        "SECRETS_DIR": str(secrets),
        "COORDINATOR_JOB": "ddp-test",
        "WORKERS": "3",
        "STEPS": "3",
    }
    result = compose(project, "up", "-d", env=env, file=DDP_COMPOSE_FILE, timeout=600)
    assert result.returncode == 0, result.stderr
    workers = service_containers(podman_service, project, "worker")
    assert len(workers) == 3
    wait_until(lambda: exited(workers), 300, "the three DDP members to finish")

    outcomes = {}
    for worker in workers:
        logs = worker.logs(stdout=True, stderr=True).decode(errors="replace")
        assert worker.attrs["State"]["ExitCode"] == 0, logs[-3000:]
        (line,) = [x for x in logs.splitlines() if x.startswith('{"rank": ')]
        outcome = json.loads(line)
        outcomes[outcome["rank"]] = outcome
        assert f"rank {outcome['rank']} step 2 loss" in logs
        variables = dict(e.split("=", 1) for e in worker.attrs["Config"]["Env"])
        assert variables["COORDINATOR_ETCD_USER"] == "/coordinator/jobs/ddp-test"
        password = (secrets / "job-password").read_text().strip()
        assert password not in "\n".join([*variables.values(), *worker.attrs["Config"]["Cmd"]])
        assert worker.attrs["HostConfig"]["ReadonlyRootfs"] is True
        assert worker.attrs["Config"]["User"] == COORDINATOR_USER
    assert sorted(outcomes) == [0, 1, 2]
    for outcome in outcomes.values():
        assert outcome["ok"] is True and outcome["all_reduce"] == 6.0  # 1 + 2 + 3
        assert len(outcome["losses"]) == 3
    # The same seed, other shards: the ranks' losses differ, DDP keeps the weights equal.
    assert len({tuple(o["losses"]) for o in outcomes.values()}) == 3


# -- least privilege ------------------------------------------------------------------


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


# -- the whole product: etcd with TLS and auth, the REST service, agents ----------------

AGENT_IDS = ("agent-1", "agent-2", "agent-3")
SECRET_FILES = ("etcd-root-password", "tokens", *(f"{a}-password" for a in AGENT_IDS))


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _token(secrets: Path, role: str) -> str:
    """The token of `role` in the token file init-secrets.sh wrote."""
    for line in (secrets / "tokens").read_text().splitlines():
        if line.split()[:1] == [role]:
            return line.split()[1]
    raise AssertionError(f"no {role} token in {secrets / 'tokens'}")


class SecureEtcd:
    """The compose etcd from the host, through a port published on loopback only (by the
    test's own override file): its certificate names 127.0.0.1, so TLS is verified."""

    def __init__(self, secrets: Path, port: int, client_certs: bool) -> None:
        self.secrets, self.endpoint = secrets, f"https://127.0.0.1:{port}"
        self.ca = str(secrets / "ca.pem")
        # With compose.client-certs.yaml etcd wants a client certificate as well.
        self.tls = {"cert": str(secrets / "client.pem"), "key": str(secrets / "client-key.pem")}
        if not client_certs:
            self.tls = {}

    def client(self, user: str | None = None, password_file: str | None = None, **kw: Any) -> Etcd:
        security = EtcdSecurity(ca=self.ca, user=user, password_file=password_file, **self.tls)
        return Etcd(self.endpoint, security=security, connect_timeout=kw.pop("timeout", 10), **kw)

    def root(self) -> Etcd:
        return self.client("root", str(self.secrets / "etcd-root-password"))


def _agents_registered(etcd: SecureEtcd) -> int:
    with etcd.root() as client:
        return client.count_prefix(client.key("agents") + "/")


def _published_etcd(folder: Path, port: int) -> Path:
    """An override that publishes etcd's port on the host's loopback, for the test alone."""
    override = folder / "etcd-port.yaml"
    override.write_text(f'services:\n  etcd:\n    ports: ["127.0.0.1:{port}:2379"]\n')
    return override


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "variant", [pytest.param("default", marks=pytest.mark.slow), "client-certs"]
)  # the default suite's budget: client-certs covers the default's path and more
def test_compose_product_with_tls_and_auth_runs_a_job_and_refuses_others_in_etcd(
    podman_service: PodmanService, images: Images, project: str, tmp_path: Path, variant: str
) -> None:
    """The default compose file (and with compose.client-certs.yaml, which also requires
    client certificates), after its one-time step (init-secrets.sh): the init container
    turns auth on and makes the agents' users, then `coordinator submit xgboost
    --workers 3` from the host succeeds on the agents over TLS with per-job users. etcd
    refuses a client without credentials (Python and etcdctl) and a plain-text one; an
    agent's credentials can neither write nor read a job record. Every container runs
    with least privilege, no secret is in any container's environment or argv, and
    `down -v` leaves nothing of the project."""
    client_certs = variant == "client-certs"
    secrets = init_secrets(tmp_path / "secrets", agents=len(AGENT_IDS), exec_token=True)
    port, etcd_port = _free_loopback_port(), _free_loopback_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "ETCD_IMAGE": images.etcd,
        "COORDINATOR_IMAGE": images.worker,
        "SECRETS_DIR": str(secrets),
        "PORT": str(port),
        "HOST_IP": "127.0.0.1",  # the default, said here: test traffic stays on loopback
        "SLOTS": "2",
    }
    files = ["-f", str(CLIENT_CERTS_FILE)] if client_certs else []
    files += ["-f", str(_published_etcd(tmp_path, etcd_port))]  # after -f compose.yaml
    result = compose(project, *files, "up", "-d", env=env, file=COMPOSE_FILE, timeout=600)
    assert result.returncode == 0, result.stderr

    (etcd_container,) = service_containers(podman_service, project, "etcd")
    (init,) = service_containers(podman_service, project, "etcd-init")
    (service,) = service_containers(podman_service, project, "service")
    agents = [c for a in AGENT_IDS for c in service_containers(podman_service, project, a)]
    assert len(agents) == len(AGENT_IDS)
    etcd = SecureEtcd(secrets, etcd_port, client_certs)

    def diagnostics() -> str:
        return "\n".join(
            f"--- {c.name}\n{c.logs(tail=40).decode(errors='replace')}"
            for c in (init, service, *agents)
        )

    init.reload()
    assert init.attrs["State"]["ExitCode"] == 0 and init.status == "exited", diagnostics()
    assert b"etcd init: auth on" in init.logs(), diagnostics()
    wait_until(lambda: _ready(url), 180, f"the service ready at {url}\n{diagnostics()}")
    wait_until(
        lambda: _agents_registered(etcd) == len(AGENT_IDS),
        90,
        f"{len(AGENT_IDS)} agents registered\n{diagnostics()}",
    )

    # etcd refuses whoever has no credentials, and plain text altogether.
    if client_certs:  # no certificate: refused in the handshake; with one, no user
        with pytest.raises(EtcdRefused, match="missing client certificate"):
            Etcd(etcd.endpoint, security=EtcdSecurity(ca=etcd.ca), connect_timeout=5).close()
        with pytest.raises(EtcdRefused):
            etcd.client().close()  # its CN (etcd-coordinator) is no etcd user
    else:
        with pytest.raises(EtcdRefused, match="missing credentials") as refused:
            etcd.client().close()
        assert refused.value.cause == "credentials"
    ctl = subprocess.run(
        [str(Path(sys.executable).with_name("etcdctl")), f"--endpoints={etcd.endpoint}",
         f"--cacert={etcd.ca}", "--command-timeout=5s", "get", "/coordinator/", "--prefix"],
        capture_output=True, text=True, timeout=30, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    assert ctl.returncode != 0 and "/coordinator/" not in ctl.stdout, ctl
    if not client_certs:
        assert "user name is empty" in ctl.stderr, ctl
    with pytest.raises(EtcdError):
        Etcd(f"127.0.0.1:{etcd_port}", security=EtcdSecurity(), connect_timeout=3).close()

    # An agent's credentials reach its own keys, never the job records.
    agent_password = str(secrets / "agent-1-password")
    with etcd.client(
        "/coordinator/agents/agent-1", agent_password, probe="assignments/agent-1/"
    ) as agent:
        with pytest.raises(EtcdRefused, match="permission denied"):
            agent.put(agent.key("api", "jobs", "forged"), '{"id": "forged"}')
        with pytest.raises(EtcdRefused, match="permission denied"):
            agent.get(agent.key("api", "jobs", "forged"))
    with etcd.root() as root:
        assert root.get(root.key("api", "jobs", "forged")) is None

    for container in (etcd_container, service, *agents):
        assert_least_privilege(
            container, ETCD_USER if container is etcd_container else COORDINATOR_USER
        )
    for container in (service, *agents):
        assert_writes_only_where_allowed(container, ["/tmp", "/data", "/artifacts"])
    # Secrets reach containers as files only: none in an environment value or argv.
    values = {(secrets / name).read_text().strip() for name in SECRET_FILES}
    values |= {line.split()[1] for line in (secrets / "tokens").read_text().splitlines()[1:]}
    for container in (etcd_container, init, service, *agents):
        config = container.attrs["Config"]
        shown = "\n".join([*(config.get("Env") or []), *(config.get("Cmd") or [])])
        assert not any(value in shown for value in values), container.name
    assert httpx.get(f"{url}/v1/jobs", timeout=5).status_code == 401, "a token is required"

    submit_token, read_token = _token(secrets, "submit"), _token(secrets, "read")
    job = f"product-{uuid.uuid4().hex[:6]}"
    params = ["rounds=5", "data=synthetic:20000x8:1", "eval_data=synthetic:5000x8:2"]
    submit = subprocess.run(
        [sys.executable, "-m", "coordinator", "submit", "xgboost", "--workers", "3",
         *(f"--param={p}" for p in params), "--id", job,
         "--server", f"http://localhost:{port}", "--token", submit_token, "--wait"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_COLOR": "1"},
    )  # fmt: skip
    headers = {"Authorization": f"Bearer {read_token}"}
    response = httpx.get(f"{url}/v1/jobs/{job}", headers=headers, timeout=10)
    said = f"{submit.stdout[-2000:]}\n{submit.stderr[-2000:]}\n{response.text[:3000]}\n"
    assert submit.returncode == 0 and response.status_code == 200, said + diagnostics()
    record = response.json()
    assert record["state"] == "SUCCEEDED"

    # Run by the agents, not by the service: every member assigned to one of them.
    assert record["spec"]["launcher"] == "agents"
    members = record["attempts"][-1]["members"]
    assert len(members) == 3
    assert all(m["assignment"].split("/")[0] in AGENT_IDS for m in members), members
    # Their output reaches the host through the service, from whichever agent ran them.
    logs = httpx.get(f"{url}/v1/jobs/{job}/logs", params={"rank": 0}, headers=headers, timeout=30)

    # The model, in the artifacts volume.
    volume = podman_service.client.volumes.get(f"{project}_artifacts")
    model = Path(volume.attrs["Mountpoint"]) / job / "model.json"
    assert model.exists() and model.stat().st_size > 0
    xgboost.Booster(model_file=str(model))  # a model xgboost reads back

    # The operator asked for an exec token (EXEC_TOKEN=1): your own program runs on the
    # agents through the service with it.
    hello = "import os; print('hello from rank', os.environ['RANK'])"
    program = subprocess.run(
        [sys.executable, "-m", "coordinator", "submit", "--workers", "2", "--id", f"{job}-prog",
         "--server", url, "--token", _token(secrets, "exec"), "--wait", "--",
         "python3", "-c", hello],
        capture_output=True, text=True, timeout=300, env={**os.environ, "NO_COLOR": "1"},
    )  # fmt: skip
    assert program.returncode == 0, f"{program.stderr[-2000:]}\n{diagnostics()}"
    said = httpx.get(f"{url}/v1/jobs/{job}-prog/logs", headers=headers, timeout=30).text
    assert "[rank 1] hello from rank 1" in said, said[-2000:]

    # The job's etcd user is gone with the job (root sees the users).
    with etcd.root() as root:
        wait_until(
            lambda: job_user(root.namespace, job) not in users(root), 30, "the job's user revoked"
        )
        assert {agent_user(root.namespace, a) for a in AGENT_IDS} <= set(users(root))

    result = compose(project, *files, "down", "-v", "-t", "10", env=env, file=COMPOSE_FILE)
    assert result.returncode == 0, result.stderr
    client = podman_service.client
    label = f"com.docker.compose.project={project}"
    assert client.containers.list(all=True, filters={"label": label}) == []
    assert [n.name for n in client.networks.list() if n.name.startswith(project)] == []
    assert [v.name for v in client.volumes.list() if v.name.startswith(project)] == []

    assert logs.status_code == 200 and "[rank 0]" in logs.text, logs.text[-2000:]
    assert record["artifacts"]["model_path"] == f"/artifacts/{job}/model.json"


def test_the_plain_opt_out_is_a_valid_compose_file_with_an_etcd_without_tls(
    podman_service: PodmanService,
) -> None:
    """compose.plain.yaml (the explicit opt-out) parses; its etcd is plain, the default's
    is TLS only."""
    files = {"TOKEN_FILE": "/dev/null", "SIGNING_KEY": "/dev/null", "SERVICE_KEY": "/dev/null"}
    plain = compose("ectestcfg", "config", env=files, file=PLAIN_COMPOSE_FILE)
    assert plain.returncode == 0, plain.stderr
    assert "--listen-client-urls=http://0.0.0.0:2379" in plain.stdout
    assert "https://" not in plain.stdout
