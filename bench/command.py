"""Ours against torchrun, running a user's program: start-up, and stopping after a lost peer.

* Start-up: the time from launch until every rank's program has printed its first
  line, at N = 4, 8, 16: `coordinator run --workers N -- PROGRAM` (with an etcd
  already running, as a deployment has) against N `torchrun --nnodes N
  --nproc-per-node 1 --rdzv-backend c10d` agents on loopback, started together.
* A lost peer, mid-all_reduce (tests/support/programs/block_in_allreduce.py: every rank but
  1 blocks in an all_reduce that rank 1 never joins), N = 4: the time from losing
  rank 1's node until every other node has stopped. Two ways to lose it:
  `kill` (SIGKILL its member, or its torchrun agent and worker: the sockets close)
  and `freeze` (SIGSTOP them: a hung machine, whose sockets stay open). Waits are
  capped at 10 minutes ("> 600 s"; `--cap`).
* Overhead: DDP training steps per second (examples/ddp_mnist.py, N = 2, from the
  first step's line to the last one's) under ours against torchrun, in alternating
  pairs (`--ddp-repeats`; `--only-ddp` runs just these).
* With `--ray-python PATH` (a Python that has `ray[default]`; Ray is not our
  dependency, so it lives in a venv of its own): start-up of `ray job submit`
  against an already running local Ray head, whose entrypoint starts N actors
  (one process each) that print their first line.

Only loopback is contacted; every process started is stopped by its pid at the end.
Run: `python bench/command.py [--sizes 4,8,16] [--ttl 5] [--ray-python /venv/bin/python]`
(the torchrun "freeze" run waits its whole 600 s cap).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.etcd.server import EmbeddedEtcd, free_port
from coordinator.launch import WorkerCommand
from tests.support.processes import piped

ROOT = Path(__file__).resolve().parent.parent
BLOCK = ROOT / "tests" / "support" / "programs" / "block_in_allreduce.py"
FIRST_LINE = [sys.executable, "-c", "import os; print('first line of rank', os.environ['RANK'])"]
CAP = 600.0
DDP = [sys.executable, str(ROOT / "examples" / "ddp_mnist.py")]
RAY_RANKS = ROOT / "bench" / "ray_ranks.py"
PIDS_DIR = tempfile.mkdtemp(prefix="bench-command-")  # where the blocking program notes pids


class Started:
    """Processes started by the bench, each in a session of its own; stopped by pid."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[str]] = []

    def start(
        self,
        args: list[str],
        on_line: Callable[[int, str], None],
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[str]:
        process = piped(
            args, {**os.environ, **(env or {})}, ROOT, subprocess.DEVNULL, new_session=True
        )
        index = len(self.processes)
        self.processes.append(process)

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                on_line(index, line.rstrip("\n"))

        threading.Thread(target=read, daemon=True).start()
        return process

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Wait for `event`; False at the deadline, or as soon as every process has exited."""
        deadline = time.monotonic() + timeout
        while not event.wait(0.1):
            if time.monotonic() > deadline or all(p.poll() is not None for p in self.processes):
                return event.is_set()
        return True

    def tree(self, process: subprocess.Popen[str]) -> list[psutil.Process]:
        try:
            root = psutil.Process(process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop_all(self) -> None:
        doomed = [p for process in self.processes for p in self.tree(process)]
        for p in doomed:
            try:
                p.send_signal(signal.SIGCONT)
                p.kill()
            except psutil.NoSuchProcess:
                pass
        for process in self.processes:
            process.wait()
        self.processes.clear()


class FirstLines:
    """When each rank's first program line arrived (monotonic)."""

    def __init__(self, n: int) -> None:
        self.n, self.seen, self.done = n, {}, threading.Event()
        self.lock = threading.Lock()

    def line(self, index: int, text: str) -> None:
        found = re.search(r"first line of rank (\d+)\b", text)
        if found is None:
            return
        rank = int(found[1])
        with self.lock:
            self.seen.setdefault(rank, time.monotonic())
            if len(self.seen) == self.n:
                self.done.set()


def torchrun_args(n: int, port: int, program: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n),
        "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench{port}", "--no-python",
        *program,
    ]  # fmt: skip


def startup_ours(etcd: EmbeddedEtcd, n: int) -> float:
    started, lines = Started(), FirstLines(n)
    began = time.monotonic()
    try:
        started.start(
            [sys.executable, "-m", "coordinator", "run", "--workers", str(n), "--etcd",
             etcd.endpoint, "--namespace", f"/bench-{n}-{free_port()}", "--", *FIRST_LINE],
            lines.line,
        )  # fmt: skip
        return (max(lines.seen.values()) - began) if started.wait(lines.done, CAP) else float("inf")
    finally:
        started.stop_all()


def startup_torchrun(n: int) -> float:
    started, lines = Started(), FirstLines(n)
    port = free_port()
    began = time.monotonic()
    try:
        for _ in range(n):
            started.start(torchrun_args(n, port, FIRST_LINE), lines.line)
        return (max(lines.seen.values()) - began) if started.wait(lines.done, CAP) else float("inf")
    finally:
        started.stop_all()


def lost_peer(
    n: int, how: str, launch: Callable[[Started, int, Callable[[int, str], None]], list[int]]
) -> float:
    """Start n nodes, wait until all but rank 1 block in all_reduce, lose rank 1's node,
    and time until every other node's process has ended."""
    started = Started()
    blocked: set[int] = set()
    ready = threading.Event()

    def on_line(index: int, text: str) -> None:
        if "entering all_reduce" in text or "rank 1 idle" in text:
            blocked.add(index)
            if len(blocked) == n:
                ready.set()

    try:
        ranks = launch(started, n, on_line)
        if not started.wait(ready, CAP):
            raise RuntimeError(f"the {n} programs did not all reach their all_reduce")
        victim = started.processes[ranks.index(1)]
        doomed = started.tree(victim)
        began = time.monotonic()
        for p in doomed:
            p.send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        others = [p for i, p in enumerate(started.processes) if ranks[i] != 1]
        deadline = began + CAP
        for process in others:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return float("inf")
        return time.monotonic() - began
    finally:
        started.stop_all()


def launch_ours(etcd: EmbeddedEtcd, ttl: int) -> Callable[[Started, int, Callable], list[int]]:
    def launch(started: Started, n: int, on_line: Callable[[int, str], None]) -> list[int]:
        ranks: dict[int, int] = {}

        def line(index: int, text: str) -> None:
            if '"phase": "leader_election"' in text:
                ranks[index] = int(text.split('"rank": ')[1].split("}")[0].split(",")[0])
            on_line(index, text)

        namespace = f"/bench-lost-{free_port()}"
        for _ in range(n):
            started.start(
                WorkerCommand(
                    job_id="lost", world_size=n, etcd=etcd.endpoint, namespace=namespace,
                    ttl=ttl, kind="command", program=(sys.executable, str(BLOCK)),
                ).process_argv(),
                line,
                env={"PIDS_DIR": PIDS_DIR},
            )  # fmt: skip
        deadline = time.monotonic() + CAP
        while len(ranks) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return [ranks[i] for i in range(n)]

    return launch


def launch_torchrun(started: Started, n: int, on_line: Callable[[int, str], None]) -> list[int]:
    ranks: dict[int, int] = {}

    def line(index: int, text: str) -> None:
        if text.startswith("rank "):
            ranks[index] = int(text.split()[1])
        on_line(index, text)

    port = free_port()
    for _ in range(n):
        started.start(
            torchrun_args(n, port, [sys.executable, str(BLOCK)]), line, env={"PIDS_DIR": PIDS_DIR}
        )
    deadline = time.monotonic() + CAP
    while len(ranks) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return [ranks[i] for i in range(n)]


class StepTimes:
    """When rank 0's first and last DDP step lines arrived."""

    def __init__(self, steps: int) -> None:
        self.last, self.first, self.at_last = steps - 1, 0.0, 0.0
        self.done = threading.Event()

    def line(self, index: int, text: str) -> None:
        found = re.search(r"\brank 0 step (\d+) loss", text)
        if found is None:
            return
        if int(found[1]) == 0:
            self.first = time.monotonic()
        elif int(found[1]) == self.last:
            self.at_last = time.monotonic()
            self.done.set()

    def rate(self) -> float:
        return self.last / (self.at_last - self.first)


def ddp_steps_per_second(etcd: EmbeddedEtcd | None, n: int, steps: int) -> float:
    """Rank 0's training steps per second, under ours (`etcd` given) or torchrun."""
    started, times = Started(), StepTimes(steps)
    program = [*DDP, "--steps", str(steps)]
    try:
        if etcd is not None:
            started.start(
                [sys.executable, "-m", "coordinator", "run", "--workers", str(n), "--etcd",
                 etcd.endpoint, "--namespace", f"/bench-ddp-{free_port()}", "--", *program],
                times.line,
            )  # fmt: skip
        else:
            port = free_port()
            for _ in range(n):
                started.start(torchrun_args(n, port, program), times.line)
        if not started.wait(times.done, CAP):
            raise RuntimeError("the DDP run did not reach its last step")
        return times.rate()
    finally:
        started.stop_all()


def startup_ray(ray_python: str, address: str, gcs: str, n: int) -> float:
    """`ray job submit` of an entrypoint starting n actors, until each printed its line."""
    started, lines = Started(), FirstLines(n)
    ray = str(Path(ray_python).parent / "ray")
    began = time.monotonic()
    try:
        started.start(
            [ray, "job", "submit", "--address", address, "--", ray_python, str(RAY_RANKS),
             str(n), gcs],
            lines.line,
        )  # fmt: skip
        return (max(lines.seen.values()) - began) if started.wait(lines.done, CAP) else float("inf")
    finally:
        started.stop_all()


def ray_head(ray_python: str) -> tuple[Started, str, str]:
    """A local Ray head on loopback (its processes, its job API and GCS addresses), ready
    for jobs; every line its actors print is passed on (no deduplication)."""
    started, ready = Started(), threading.Event()
    ray = str(Path(ray_python).parent / "ray")
    dashboard, gcs = free_port(), free_port()
    started.start(
        [ray, "start", "--head", "--block", "--port", str(gcs), "--num-cpus", "2",
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
         "--node-ip-address", "127.0.0.1", "--disable-usage-stats"],
        lambda index, text: None,
        env={"RAY_DEDUP_LOGS": "0"},
    )  # fmt: skip
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.monotonic() + 120
    while not ready.is_set() and time.monotonic() < deadline:
        probe = subprocess.run(
            [ray, "job", "list", "--address", address], capture_output=True, check=False
        )
        if probe.returncode == 0:
            ready.set()
        else:
            time.sleep(1)
    if not ready.is_set():
        started.stop_all()
        raise RuntimeError("the Ray head did not start within 120 s")
    return started, address, f"127.0.0.1:{gcs}"


def ddp(etcd: EmbeddedEtcd, args: argparse.Namespace) -> None:
    """DDP steps per second, ours against torchrun, in alternating pairs (a drift in the
    machine's load then hits both)."""
    ratios = []
    for _ in range(args.ddp_repeats):
        ours = ddp_steps_per_second(etcd, 2, args.ddp_steps)
        theirs = ddp_steps_per_second(None, 2, args.ddp_steps)
        ratios.append(ours / theirs)
        print(f"DDP steps/s, N=2: ours {ours:.1f}  torchrun {theirs:.1f}  ours/torchrun "
              f"{ours / theirs:.2f}")  # fmt: skip
    print(f"DDP steps/s ours/torchrun: median {statistics.median(ratios):.2f} of {len(ratios)}")


def seconds(value: float) -> str:
    return f"> {CAP:g} s" if value == float("inf") else f"{value:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,8,16")
    parser.add_argument("--ttl", type=int, default=5, help="our lease TTL in the lost-peer runs")
    parser.add_argument("--lost-n", type=int, default=4)
    parser.add_argument("--ddp-steps", type=int, default=300)
    parser.add_argument("--ddp-repeats", type=int, default=3, help="alternating DDP pairs")
    parser.add_argument("--only-ddp", action="store_true", help="just the DDP steps/s runs")
    parser.add_argument("--ray-python", help="a Python with ray[default], to compare Ray jobs")
    parser.add_argument("--skip-lost", action="store_true", help="leave out the lost-peer runs")
    args = parser.parse_args()
    os.umask(0o077)
    with EmbeddedEtcd() as etcd:
        etcd.security.export()
        if args.only_ddp:
            ddp(etcd, args)
            return
        print("start-up: launch until every rank's first program line")
        print(f"{'N':>4} {'ours':>10} {'torchrun':>10} {'torchrun/ours':>14}")
        for n in map(int, args.sizes.split(",")):
            ours, theirs = startup_ours(etcd, n), startup_torchrun(n)
            print(f"{n:>4} {seconds(ours):>10} {seconds(theirs):>10} {theirs / ours:>14.2f}")
        if args.ray_python:
            head, address, gcs = ray_head(args.ray_python)
            try:
                print("start-up: `ray job submit` (a Ray head already up), N actors' first lines")
                print(f"{'N':>4} {'ours':>10} {'ray':>10} {'ray/ours':>14}")
                for n in map(int, args.sizes.split(",")):
                    ours = startup_ours(etcd, n)
                    theirs = startup_ray(args.ray_python, address, gcs, n)
                    row = f"{seconds(ours):>10} {seconds(theirs):>10} {theirs / ours:>14.2f}"
                    print(f"{n:>4} {row}")
            finally:
                head.stop_all()
        ddp(etcd, args)
        if args.skip_lost:
            return
        n = args.lost_n
        print(
            f"lost peer mid-all_reduce, N={n}: until every survivor stopped (ours: TTL {args.ttl}s,"
        )
        print("grace 10 s; torchrun: its defaults)")
        for how in ("kill", "freeze"):
            ours = lost_peer(n, how, launch_ours(etcd, args.ttl))
            theirs = lost_peer(n, how, launch_torchrun)
            ratio = "" if ours == float("inf") else f"{min(theirs, CAP) / ours:.1f}x"
            print(f"{how:>6} ours {seconds(ours):>10}  torchrun {seconds(theirs):>10}  {ratio}")


if __name__ == "__main__":
    main()
