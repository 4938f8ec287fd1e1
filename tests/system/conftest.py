"""Fixtures of the system tests: every process, service, agent and `coordinator` run a test
starts is stopped at its end, also when it fails."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from tests.support.agents import AgentProc, SlotWatch
from tests.support.commands import Run
from tests.support.processes import Proc
from tests.support.service import ServiceProc, kill_members


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


@pytest.fixture
def serve(
    etcd_server: EmbeddedEtcd, namespace: str, tmp_path: Path
) -> Iterator[Callable[..., ServiceProc]]:
    """Start `coordinator serve` on the session's etcd, ready to answer; at the end each
    is stopped and every member it started killed."""
    started: list[ServiceProc] = []

    def start(*extra: str, data: Path | None = None, exec_token: bool = True) -> ServiceProc:
        folder = data or tmp_path / f"service-{len(started)}"
        folder.mkdir(exist_ok=True)
        service = ServiceProc(
            etcd_server.endpoint, namespace, folder, *extra, exec_token=exec_token
        )
        started.append(service)
        return service.ready()

    yield start
    for service in started:
        service.stop()
    for service in started:
        kill_members(service.data)


@pytest.fixture
def agents(etcd_server: EmbeddedEtcd, namespace: str, tmp_path: Path) -> Iterator[Any]:
    """Start `coordinator agent` processes on the session's etcd; each killed at the end."""
    started: list[AgentProc] = []

    def start(*extra: str) -> AgentProc:
        agent = AgentProc(etcd_server.endpoint, namespace, tmp_path / f"a{len(started)}", *extra)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.stop()


@pytest.fixture
def slots(etcd: Etcd) -> Iterator[SlotWatch]:
    """What the agents of this test's namespace report, watched from its start."""
    watch = SlotWatch(etcd)
    yield watch
    watch.close()


@pytest.fixture
def launch() -> Iterator[Callable[..., Run]]:
    """Start `coordinator ...` runs; each one's process group is killed at the end."""
    runs: list[Run] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> Run:
        runs.append(Run(args, env))
        return runs[-1]

    yield start
    for run in runs:
        run.kill()
