"""The REST service's docker launcher with real containers on podman.

etcd runs as a container on a podman network, with auth on: the service (on the host,
as etcd's root) reaches it at its address there, the members (containers on that
network) by its name, which `--docker-etcd` gives them in place of the service's own
endpoint, and as their job's etcd user, whose password the launcher mounts.
"""

from __future__ import annotations

import ipaddress
import json
import os
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker.models.containers import Container

from coordinator.etcd.client import Etcd
from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.users import (
    ROOT,
    enable_auth,
    job_user,
    new_password,
    provision_job,
    write_password_file,
)
from coordinator.launch import WorkerCommand
from coordinator.service.launchers import VANISHED, Launch
from coordinator.service.launchers.docker import MANAGED_LABEL, RUN_LABEL, DockerLauncher
from coordinator.service.launchers.docker_container import MEMBER_PASSWORD_FILE, MEMBER_UID
from coordinator.service.model import JobSpec, Member
from coordinator.worker import EXIT_INTERRUPTED
from tests.support.containers import (
    COORDINATOR_USER,
    LABEL,
    Images,
    PodmanService,
    assert_least_privilege,
    assert_writes_only_where_allowed,
)
from tests.support.service import ServiceProc, wait_state
from tests.support.wait import wait_until

# Real containers, and the images they need built: with the slow tests (the budget).
pytestmark = [pytest.mark.containers, pytest.mark.slow]

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


class Cluster:
    """A test network (labelled, removed afterwards) with an etcd container on it, whose
    auth is on (root's password in a private file of the test's)."""

    def __init__(self, podman: PodmanService, images: Images, folder: Path) -> None:
        self.client = podman.client
        self.prefix = f"ectest{uuid.uuid4().hex[:8]}"
        self.network = self.client.networks.create(
            self.prefix, driver="bridge", labels={LABEL: "1"}
        )
        self.etcd_name = f"{self.prefix}-etcd"
        self.artifacts = f"{self.prefix}-artifacts"  # the members' volume, removed afterwards
        self.etcd: Container = self.client.containers.run(
            images.etcd,
            [
                "/usr/local/bin/etcd", "--name=etcd", "--data-dir=/var/lib/etcd",
                "--listen-client-urls=http://0.0.0.0:2379",
                f"--advertise-client-urls=http://{self.etcd_name}:2379",
            ],
            name=self.etcd_name, network=self.prefix, detach=True, labels={LABEL: "1"},
        )  # fmt: skip
        self.etcd.reload()
        address = self.etcd.attrs["NetworkSettings"]["Networks"][self.prefix]["IPAddress"]
        self.host_endpoint = f"{address}:2379"  # the host reaches container addresses
        self.container_endpoint = f"{self.etcd_name}:2379"  # containers resolve names
        self.root_password = write_password_file(folder / "etcd" / "root", new_password())
        self.security = EtcdSecurity(user=ROOT, password_file=str(self.root_password))
        with self.root("") as etcd:  # up and answering, then auth on
            enable_auth(etcd, self.security.password())

    def root(self, namespace: str) -> Etcd:
        return Etcd(
            self.host_endpoint, namespace=namespace, security=self.security, connect_timeout=30
        )

    def job_id(self, kind: str) -> str:
        """A job id of this test's own: its containers are found by it afterwards."""
        return f"{kind}-{self.prefix}"

    def members(self, run_id: str | None = None) -> list[Container]:
        """The product-labelled containers of this test's jobs (or of one submission)."""
        found = self.client.containers.list(all=True, filters={"label": RUN_LABEL})
        mine = [c for c in found if self.prefix in c.labels[RUN_LABEL]]
        return [c for c in mine if run_id is None or c.labels[RUN_LABEL] == run_id]

    def close(self) -> None:
        for container in [*self.members(), self.etcd]:
            container.remove(force=True, v=True)
        for network in self.client.networks.list():  # ours, and the one a launcher made
            if network.name.startswith(self.prefix):
                network.remove()
        for volume in self.client.volumes.list():  # what a launcher created for its members
            if volume.name.startswith(self.prefix):
                volume.remove(force=True)


@pytest.fixture
def cluster(podman_service: PodmanService, images: Images, tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(podman_service, images, tmp_path)
    try:
        yield cluster
    finally:
        cluster.close()


def secret_mount(container: Container) -> Path:
    """The host file mounted as the member's etcd password: read-only, 0400, uid 10001's."""
    mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
    mount = mounts[MEMBER_PASSWORD_FILE]
    assert mount["RW"] is False, container.name
    source = Path(mount["Source"])
    status = source.stat()
    assert (status.st_uid, stat.S_IMODE(status.st_mode)) == (MEMBER_UID, 0o400), container.name
    return source


def assert_hardened(container: Container, memory: int, pids: int) -> None:
    """What the docker launcher gives a member, as the engine reports it: compose's least
    privilege (user, read-only root, tmpfs /tmp, no capabilities, no-new-privileges), the
    limits, and a writable artifacts volume."""
    container.reload()
    host, name = container.attrs["HostConfig"], container.name
    assert container.attrs["Config"]["User"] == COORDINATOR_USER, name
    assert host["ReadonlyRootfs"] is True, name
    assert "/tmp" in (host.get("Tmpfs") or {}), name
    assert not host.get("CapAdd"), name
    dropped = {cap.removeprefix("CAP_") for cap in host["CapDrop"] or []}
    assert "ALL" in dropped or {"CHOWN", "DAC_OVERRIDE", "SETUID", "SETGID"} <= dropped, name
    assert any(opt.startswith("no-new-privileges") for opt in host["SecurityOpt"] or []), name
    assert host["PidsLimit"] == pids, name
    assert host["Memory"] == memory, name
    mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
    assert mounts["/artifacts"]["RW"] is True, name


@pytest.mark.timeout(1800)  # the first to need the worker image may build it (minutes)
def test_a_docker_job_runs_its_members_as_containers_on_the_network(
    podman_service: PodmanService, images: Images, cluster: Cluster, tmp_path: Path
) -> None:
    """An xgboost job with the docker launcher: two containers on the network, reaching
    etcd by name; ranks, container ids, exit codes and logs recorded; a second submit of
    the same spec starts nothing; `remove` deletes the submission's containers."""
    image = images.worker  # built here if need be: not part of the job's time
    started = time.monotonic()
    service = ServiceProc(
        cluster.host_endpoint, f"/{cluster.prefix}", tmp_path / "data",
        "--docker-image", image, "--docker-host", podman_service.url,
        "--docker-network", cluster.prefix, "--docker-etcd", cluster.container_endpoint,
        "--docker-artifacts", cluster.artifacts,
        "--docker-memory", "768m", "--docker-pids-limit", "256",
        "--etcd-user", ROOT, "--etcd-password-file", str(cluster.root_password),
        member_ttl=5,
    ).ready()  # fmt: skip
    try:
        job = cluster.job_id("xgb")
        spec = {
            "id": job, "kind": "xgboost", "workers": 2, "launcher": "docker",
            "params": {"rounds": 5},
        }  # fmt: skip
        response = service.http.post("/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        record = wait_state(service, job, TERMINAL, 300)
        assert record["state"] == "SUCCEEDED", (record, service.output())
        run_id = f"{job}-{record['uid'][:8]}"

        members = record["attempts"][-1]["members"]
        assert sorted(m["rank"] for m in members) == [0, 1]
        containers = {c.id: c for c in cluster.members(run_id)}
        assert len(containers) == 2
        subnet = ipaddress.ip_network(cluster.network.attrs["IPAM"]["Config"][0]["Subnet"])
        for member in members:
            assert member["exit_code"] == 0
            container = containers[member["container"]]
            assert container.name == f"{run_id}-a1-m{member['index']}"
            assert container.attrs["State"]["ExitCode"] == 0
            assert cluster.prefix in container.attrs["NetworkSettings"]["Networks"]
            # It advertised its own address on the job's network.
            assert ipaddress.ip_address(member["address"].rpartition(":")[0]) in subnet
            assert_hardened(container, memory=768 * 2**20, pids=256)
            # It connected as its job's user, whose password only it was given, as a file.
            variables = dict(e.split("=", 1) for e in container.attrs["Config"]["Env"])
            assert variables["COORDINATOR_ETCD_USER"] == job_user(f"/{cluster.prefix}", job)
            assert variables["COORDINATOR_ETCD_PASSWORD_FILE"] == MEMBER_PASSWORD_FILE
            shown = "\n".join([*variables.values(), *container.attrs["Config"]["Cmd"]])
            assert cluster.security.password() not in shown
            assert cluster.root_password.name not in shown, "never the service's root"
        (password_source,) = {secret_mount(c) for c in containers.values()}
        assert password_source.exists()

        logs = service.http.get(f"/v1/jobs/{job}/logs")
        assert logs.status_code == 200
        for rank in (0, 1):
            events = [
                json.loads(line.removeprefix(f"[rank {rank}] "))
                for line in logs.text.splitlines()
                if line.startswith(f"[rank {rank}] {{")
            ]
            assert any(e["event"] == "done" and e["rank"] == rank for e in events), logs.text
            assert [e["round"] for e in events if e["event"] == "round"] == [1, 2, 3, 4, 5]

        again = service.http.post("/v1/jobs", json=spec)
        assert again.status_code == 200 and again.json()["uid"] == record["uid"]
        assert service.job(job)["state"] == "SUCCEEDED"
        assert {c.id for c in cluster.members()} == set(containers), "no new container"

        # A launcher asked again for a member (a new leader) finds it, starts none.
        launcher = DockerLauncher(
            images.worker, cluster.prefix, podman_service.url, "x:2379",
            artifacts=cluster.artifacts, secrets_dir=tmp_path / "secrets",
        )  # fmt: skip
        first = next(m for m in members if m["index"] == 0)
        again_command = WorkerCommand(job_id=run_id.rsplit("-", 1)[0], world_size=2)
        again_launch = Launch(run_id, 1, JobSpec(kind="xgboost", workers=2), again_command)
        assert launcher.start(again_launch, 0).container == first["container"]
        assert {c.id for c in cluster.members()} == set(containers)

        assert launcher.remove(run_id) == 2
        assert cluster.members(run_id) == []
        # Deleting the job removes what the service's launcher wrote for it.
        assert service.http.delete(f"/v1/jobs/{job}").status_code in (200, 204)
        wait_until(lambda: not password_source.exists(), 30, "the password file removed")
        print(f"docker job: {time.monotonic() - started:.1f}s")
    finally:
        service.stop()


@pytest.mark.timeout(300)
def test_the_launcher_creates_its_network_and_stops_removes_and_follows_containers(
    podman_service: PodmanService, images: Images, cluster: Cluster, tmp_path: Path
) -> None:
    """The launcher directly: a missing network is created (labelled); a running member
    runs hardened (as the kernel applies it) with its job's password as a read-only
    file only uid 10001 reads; SIGTERM ends a member cleanly (130, it says why), output
    reads from an offset, a removed container is VANISHED (its password file gone), and
    stopping what is gone is a no-op."""
    network = f"{cluster.prefix}-own"
    launcher = DockerLauncher(
        images.worker,
        network,
        podman_service.url,
        cluster.container_endpoint,
        memory="512m",
        pids_limit=128,
        artifacts=cluster.artifacts,
        secrets_dir=tmp_path / "secrets",
    )
    launcher.ensure_network()
    created = podman_service.client.networks.get(network)
    assert created.attrs["Labels"][MANAGED_LABEL] == "true"
    created.connect(cluster.etcd)  # so members on it reach etcd by name
    job = cluster.job_id("noop")
    command = WorkerCommand(
        job_id=job, world_size=1, etcd="127.0.0.1:2379",  # replaced
        namespace=f"/{cluster.prefix}", kind="noop", params={"seconds": "600"},
    )  # fmt: skip
    with cluster.root(f"/{cluster.prefix}") as root:
        credentials = provision_job(root, job)
    spec = JobSpec(kind="noop", workers=1)
    launch = Launch(f"{job}-run", 1, spec, command, credentials=credentials)
    member = launcher.start(launch, 0)
    assert launcher.start(launch, 0) == member

    def output() -> str:
        return launcher.output(member, 0).decode(errors="replace")

    def holding() -> bool:  # noop holds `seconds` after connect
        return '"phase": "connect"' in output() or launcher.exit_code(member) is not None

    wait_until(holding, 60, "the member past connect")
    assert launcher.exit_code(member) is None, output()
    container = podman_service.client.containers.get(member.container)
    assert_hardened(container, memory=512 * 2**20, pids=128)
    assert_least_privilege(container, COORDINATOR_USER)
    assert_writes_only_where_allowed(container, ["/tmp", "/artifacts"])
    code, read = container.exec_run(["cat", MEMBER_PASSWORD_FILE])
    assert code == 0 and read.decode().strip() == credentials.password
    code, _ = container.exec_run(["sh", "-c", f"echo x > {MEMBER_PASSWORD_FILE}"])
    assert code != 0, "the password file is read-only"
    source = secret_mount(container)
    assert source == launcher.password_path(launch.run_id)
    assert stat.S_IMODE(os.stat(source.parent).st_mode) == 0o700
    whole = launcher.output(member, 0)
    assert launcher.output(member, 10) == whole[10:]
    # A record naming a container the launcher did not make for that index (a forgery)
    # finds nothing: the bystander etcd and the member itself under another index live on.
    for forged in (
        Member(index=0, container=cluster.etcd.id),
        Member(index=1, container=member.container),
    ):
        launcher.kill(forged)
        assert launcher.exit_code(forged) == VANISHED and launcher.output(forged, 0) == b""
    cluster.etcd.reload()
    assert cluster.etcd.status == "running" and launcher.exit_code(member) is None
    launcher.terminate(member)
    code = wait_until(
        lambda: (c := launcher.exit_code(member)) is not None and str(c), 20, "SIGTERM to end it"
    )
    assert int(code) == EXIT_INTERRUPTED, output()
    assert "SIGTERM" in output()
    launcher.kill(member)  # exited: nothing to do
    assert launcher.remove(f"{job}-run") == 1
    assert not source.exists() and not source.parent.exists()
    assert launcher.exit_code(member) == VANISHED
    launcher.terminate(member)
    launcher.kill(member)
    assert launcher.output(member, 0) == b""


@pytest.mark.timeout(600)
@pytest.mark.slow  # a service and two member containers: about two minutes here
def test_a_command_job_runs_in_containers_of_an_allowed_image_and_others_are_refused(
    podman_service: PodmanService, images: Images, cluster: Cluster, tmp_path: Path
) -> None:
    """A `command` job on the docker launcher: each member is a container of the job's
    image (here the service's own, allowed by --allowed-image's glob), running
    `coordinator worker --kind command -- PROGRAM`, with the job's env in the container's
    environment and its working_dir as the container's; the program sees the contract's
    variables. An image outside the allowlist is a 422 naming `image`."""
    image = images.worker
    repository = image.rpartition(":")[0]
    started = time.monotonic()
    service = ServiceProc(
        cluster.host_endpoint, f"/{cluster.prefix}", tmp_path / "data",
        "--docker-image", image, "--docker-host", podman_service.url,
        "--docker-network", cluster.prefix, "--docker-etcd", cluster.container_endpoint,
        "--docker-artifacts", cluster.artifacts,
        "--etcd-user", ROOT, "--etcd-password-file", str(cluster.root_password),
        "--allowed-image", f"{repository}:*",
        member_ttl=5,
    ).ready()  # fmt: skip
    try:
        refused = service.http.post(
            "/v1/jobs",
            json={"kind": "command", "workers": 1, "launcher": "docker",
                  "command": ["true"], "image": "localhost/someone-else/tools:1"},
        )  # fmt: skip
        assert refused.status_code == 422, refused.text
        assert refused.json()["detail"][0]["loc"][-1] == "image"

        job = cluster.job_id("prog")
        show = (
            "import os; print('ran', os.environ['RANK'], os.environ['WORLD_SIZE'], "
            "os.environ['GREETING'], os.getcwd(), os.environ['MASTER_ADDR'] != '127.0.0.1')"
        )
        spec = {
            "id": job, "kind": "command", "workers": 2, "launcher": "docker",
            "command": ["python3", "-c", show], "env": {"GREETING": "hello-there"},
            "working_dir": "/opt/coordinator", "image": image,
        }  # fmt: skip
        response = service.http.post("/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        record = wait_state(service, job, TERMINAL, 300)
        assert record["state"] == "SUCCEEDED", (record, service.output())
        run_id = f"{job}-{record['uid'][:8]}"
        containers = cluster.members(run_id)
        assert len(containers) == 2
        for container in containers:
            config = container.attrs["Config"]
            assert config["Image"] == image or container.image.tags == [image]
            assert config["Entrypoint"] == ["coordinator"]
            assert config["WorkingDir"] == "/opt/coordinator"
            assert "GREETING=hello-there" in config["Env"]
            assert config["Cmd"][:1] == ["worker"] and "--kind" in config["Cmd"]
            assert config["Cmd"][config["Cmd"].index("--") + 1 :] == ["python3", "-c", show]
            assert_hardened(container, memory=2 * 2**30, pids=1024)
        logs = service.http.get(f"/v1/jobs/{job}/logs").text
        for rank in (0, 1):
            # Its own address on the network as MASTER_ADDR, not a loopback one.
            assert f"[rank {rank}] ran {rank} 2 hello-there /opt/coordinator True" in logs, logs
        print(f"docker command job: {time.monotonic() - started:.1f}s")
    finally:
        service.stop()
