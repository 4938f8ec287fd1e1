"""The `coordinator` command as users run it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.security import ENV, EtcdSecurity
from coordinator.etcd.server import EmbeddedEtcd, free_port
from coordinator.rendezvous.address import ADVERTISE_ENV, advertise_address, route_address
from coordinator.worker import EXIT_ETCD_UNAVAILABLE
from tests.support.processes import unreachable_etcd, worker_args


def coordinator(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readmes_first_command_trains_xgboost_end_to_end(tmp_path: Path) -> None:
    """The README's first command as written, run as a new user would: in an empty folder,
    no etcd settings, the embedded etcd; every worker passes and the model is saved."""
    first = README.read_text().split("```sh\n", 1)[1].splitlines()[0]
    command = first.split("#")[0].split("&&")[-1].split()
    assert command[:2] == ["coordinator", "run"], first
    unset = {*ENV.values(), "COORDINATOR_ARTIFACTS"}
    clean = {k: v for k, v in os.environ.items() if k not in unset}
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", *command[1:]],
        cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "workers passed every phase and cleaned up" in result.stderr
    assert len(list(tmp_path.glob("artifacts/*/model.json"))) == 1


def test_run_noop_with_the_embedded_etcd() -> None:
    """Embedded etcd, four local workers, every phase, and the roster table."""
    result = coordinator("run", "noop", "--workers", "4")
    assert result.returncode == 0, result.stderr
    assert "all 4 workers passed every phase and cleaned up" in result.stderr
    for rank in range(4):
        assert f"│ {rank}    │ 127.0.0.1:" in result.stderr


def test_run_reports_failing_workers_and_their_exit_code() -> None:
    """Workers that cannot reach etcd: `run` names the cause and exits with their code."""
    result = coordinator(
        "run",
        "noop",
        "--workers",
        "2",
        "--etcd",
        unreachable_etcd(free_port()),
        "--connect-timeout",
        "0.5",
    )
    assert result.returncode == EXIT_ETCD_UNAVAILABLE
    assert result.stderr.count("exited 3:") == 2
    assert "cannot reach etcd" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "0"], "world-size"),
        (["--kind", "nope"], "kind"),
        (["--job", "bad/id"], "job id 'bad/id'"),
        (["--etcd", "nohost"], "is not HOST:PORT"),
    ],
)
def test_worker_usage_errors_name_the_field(args: list[str], message: str) -> None:
    base = {"--job": "j", "--world-size": "2", "--etcd": unreachable_etcd()}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    flat = [item for pair in base.items() for item in pair]
    result = coordinator("worker", *flat, "--connect-timeout", "0.5")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_exit_codes_are_listed() -> None:
    result = coordinator("exit-codes")
    assert result.returncode == 0
    assert "   5  MemberLost: another member died" in result.stdout


def test_address_follows_the_route_to_etcd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADVERTISE_ENV, raising=False)
    assert route_address("127.0.0.1", 2379) == "127.0.0.1"
    assert advertise_address(["127.0.0.1:2379"]) == "127.0.0.1"


def test_address_override_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADVERTISE_ENV, "10.1.2.3")
    assert advertise_address(["127.0.0.1:2379"]) == "10.1.2.3"
    assert advertise_address(["127.0.0.1:2379"], override="192.0.2.7") == "192.0.2.7"


def test_advertised_override_reaches_the_roster(
    etcd_server: EmbeddedEtcd, namespace: str, spawn
) -> None:
    """An address given by flag is what the others see (and the leader connects to)."""
    procs = [
        spawn(worker_args(etcd_server.endpoint, namespace, "job", 2, advertise_address="127.0.0.1"))
        for _ in range(2)
    ]
    assert [p.wait_exit(60) for p in procs] == [0, 0]
    roster = procs[0].wait_event(lambda e: e["event"] == "done")["roster"]
    assert {m["host"] for m in roster["members"]} == {"127.0.0.1"}


def test_ctrl_c_stops_the_embedded_etcd() -> None:
    """`coordinator etcd` serves until SIGINT, then stops its etcd child and exits."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "etcd"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "1000"},  # rich: the settings line unwrapped
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        endpoint = proc.stdout.readline().strip()
        settings = next(line for line in proc.stderr if "--etcd-password-file" in line).split()
        given = dict(zip(settings[2::2], settings[3::2], strict=True))  # "auth on: --etcd-..."
        root = EtcdSecurity(
            **{k.removeprefix("--etcd-").replace("-", "_"): v for k, v in given.items()}
        )
        with Etcd(endpoint, connect_timeout=5, security=root) as etcd:
            assert etcd.put("/k", "v") > 0
        children = psutil.Process(proc.pid).children()
        assert [c.name() for c in children] == ["etcd"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, "etcd outlived the command"
    finally:
        proc.kill()
        proc.wait()
