"""Fixtures of every layer: the `--etcd-from` option, one real etcd server per session
(embedded, or in a container), a fresh namespace and client per test. The harnesses
they use are in tests/support; system/conftest.py adds the process fixtures."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.security import ENV
from coordinator.etcd.server import EmbeddedEtcd
from tests.support.containers import (
    Images,
    PodmanService,
    build_images,
    containers_available,
)
from tests.support.etcd_container import EtcdContainer


def pytest_configure(config: pytest.Config) -> None:
    # Tests send SIGINT to the processes they start, as Ctrl-C would. A shell that runs the
    # suite in the background ignores SIGINT, and every child inherits that: undo it here.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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
        # With both, the runs against etcd in a container go with the slow tests: the
        # default suite's budget (they build the container images, too).
        params = [
            pytest.param(s, marks=pytest.mark.slow) if len(sources) > 1 and s == "container" else s
            for s in sources
        ]
        metafunc.parametrize("etcd_source", params, scope="session")


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
