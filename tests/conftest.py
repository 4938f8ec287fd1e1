"""Shared fixtures: one real etcd server per session, a fresh namespace per test,
and real processes that are always stopped, also when a test fails."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.security import ENV, EtcdSecurity
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.etcd.users import ROOT, enable_auth, new_password, write_password_file
from tests.containers.harness import (
    LABEL,
    Images,
    PodmanService,
    build_images,
    containers_available,
)

TESTS = Path(__file__).parent


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `condition` until it is truthy; fail the test naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class Proc:
    """A child process whose stdout JSON lines and stderr are collected as they come."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.process = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self.exited_at: float | None = None
        self._changed = threading.Condition()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._changed:
                self.events.append(event)
                self._changed.notify_all()
        self.process.wait()
        with self._changed:
            self.exited_at = time.monotonic()
            self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._changed:
                self.stderr.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_event(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 30
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.exited_at is not None:
                    raise AssertionError(
                        f"no matching event from {self.args[-8:]} (exit {self.process.poll()}); "
                        f"events {self.events}; stderr {self.stderr[-5:]}"
                    )
                self._changed.wait(remaining)

    def wait_exit(self, timeout: float = 60) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"{self.args[-8:]} still running after {timeout}s; last events "
                f"{self.events[-3:]}; its threads:\n" + "\n".join(self.threads())
            ) from exc
        with self._changed:  # let the reader record the exit time and last lines
            self._changed.wait_for(lambda: self.exited_at is not None, timeout=5)
        return code

    def threads(self) -> list[str]:
        """Where each thread of a member that is still running is (its SIGUSR1 dump)."""
        with self._changed:
            start = len(self.stderr)
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGUSR1)
            self._changed.wait_for(
                lambda: any("Current thread" in line for line in self.stderr[start:]), timeout=5
            )
            seen = 0
            while seen < len(self.stderr):  # until the dump's lines stop coming
                seen = len(self.stderr)
                self._changed.wait_for(lambda n=seen: len(self.stderr) > n, timeout=0.5)
            return self.stderr[start:]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--etcd-from",
        choices=["embedded", "container", "both"],
        default=None,
        help="where the tests' etcd runs: a child process, a testcontainers container, or "
        "each in turn (default: both where podman is installed, else embedded)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that uses `etcd_server` runs once per etcd source."""
    if "etcd_source" in metafunc.fixturenames:
        choice = metafunc.config.getoption("--etcd-from")
        if choice is None:
            choice = "both" if containers_available() is None else "embedded"
        sources = ["embedded", "container"] if choice == "both" else [choice]
        if metafunc.definition.get_closest_marker("one_etcd") and len(sources) > 1:
            sources = sources[:1]  # what it tests does not depend on where etcd runs
        later = metafunc.definition.get_closest_marker("container_etcd_slow") is not None
        params = [
            pytest.param(s, marks=pytest.mark.slow) if later and s == "container" else s
            for s in sources
        ]
        metafunc.parametrize("etcd_source", params, scope="session")


class EtcdContainer:
    """etcd in a container started by testcontainers, with auth on as the product runs it
    (a root password in a private file of the test session's); as on EmbeddedEtcd,
    `endpoint` and `security`."""

    def __init__(self, image: str, folder: Path) -> None:
        from testcontainers.core.container import DockerContainer

        self.container = (
            DockerContainer(image, labels={LABEL: "1"})
            .with_command(
                "/usr/local/bin/etcd --name=etcd --data-dir=/var/lib/etcd "
                "--listen-client-urls=http://0.0.0.0:2379 "
                "--advertise-client-urls=http://127.0.0.1:2379 --bcrypt-cost=4"
            )
            .with_exposed_ports(2379)
            .start()
        )
        host = self.container.get_container_host_ip()
        self.endpoint = f"{host}:{self.container.get_exposed_port(2379)}"
        password = new_password()
        password_file = write_password_file(folder / "root.password", password)
        with Etcd(self.endpoint, connect_timeout=30, security=EtcdSecurity()) as plain:
            enable_auth(plain, password)
        self.security = EtcdSecurity(user=ROOT, password_file=str(password_file))

    def stop(self) -> None:
        self.container.stop()


@pytest.fixture(scope="session")
def podman_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodmanService]:
    """podman's Docker API; container tests skip without podman, except in CI."""
    missing = containers_available()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"container tests must run in CI: {missing}")
        pytest.skip(missing)
    service = PodmanService(tmp_path_factory.mktemp("podman"))
    try:
        yield service
    finally:
        service.remove_labelled()
        service.stop()


@pytest.fixture(scope="session")
def images(podman_service: PodmanService) -> Images:
    return build_images()


@pytest.fixture(scope="session")
def etcd_server(
    etcd_source: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    # Auth on, as the product runs it. The root settings go into the environment, where
    # every client of the tests and every process they start (and the members those start)
    # finds them.
    saved = {var: os.environ.get(var) for var in ENV.values()}
    server: Any = None
    try:
        if etcd_source == "embedded":
            server = EmbeddedEtcd().start()
        else:
            folder = tmp_path_factory.mktemp("etcd-container")
            server = EtcdContainer(request.getfixturevalue("images").etcd, folder)
        server.security.export()
        yield server
    finally:
        if isinstance(server, EmbeddedEtcd):
            server.close()
        elif server is not None:
            server.stop()
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


@pytest.fixture
def namespace() -> str:
    return f"/test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def etcd(etcd_server: EmbeddedEtcd, namespace: str) -> Iterator[Etcd]:
    client = Etcd(etcd_server.endpoint, namespace=namespace)
    yield client
    client.close()


@pytest.fixture
def spawn() -> Iterator[Callable[[list[str]], Proc]]:
    """Start processes; every one still running at the end of the test is killed."""
    started: list[Proc] = []

    def start(args: list[str]) -> Proc:
        proc = Proc(args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


def worker_args(
    endpoint: str, namespace: str, job: str, world_size: int, **options: Any
) -> list[str]:
    """Command line of a real `coordinator worker` process."""
    args = [
        sys.executable, "-m", "coordinator", "worker", "--job", job,
        "--world-size", str(world_size), "--etcd", endpoint, "--namespace", namespace,
    ]  # fmt: skip
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def member_proc_args(
    endpoint: str, namespace: str, job: str, world_size: int, **options: Any
) -> list[str]:
    """Command line of a test member that can stall before a phase (tests/member_proc.py)."""
    args = [
        sys.executable, str(TESTS / "member_proc.py"), "--job", job,
        "--world-size", str(world_size), "--etcd", endpoint, "--namespace", namespace,
    ]  # fmt: skip
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    return args
