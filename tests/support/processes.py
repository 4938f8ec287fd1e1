"""Real child processes for the tests: `Proc` collects a child's JSON lines and stderr as
they come, so a test waits on what it printed; and the command lines of the members
the tests start (`coordinator worker`, and member_proc.py that can stall at a phase)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

MEMBER_PROC = Path(__file__).with_name("member_proc.py")


def piped(
    args: list[str],
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stderr: int = subprocess.PIPE,
    new_session: bool = False,
) -> subprocess.Popen[str]:
    """`args` started with stdin closed (a child never waits on a terminal) and its
    stdout, and stderr unless told otherwise, piped as text; `new_session`: in a session
    of its own, so that its process group can be killed whole."""
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True,
        env=env, cwd=cwd, start_new_session=new_session,
    )  # fmt: skip


class Proc:
    """A child process whose stdout JSON lines and stderr are collected as they come."""

    def __init__(
        self, args: list[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.args = args
        self.process = piped(args, env, cwd)
        self.started_at = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self.exited_at: float | None = None
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

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

    def children(self) -> list[str]:
        """Its child processes (a member's program): pid, state, command line, and where a
        Python one's threads are (py-spy's dump, when py-spy is there)."""
        try:
            found = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        described = []
        for child in found:
            with contextlib.suppress(psutil.NoSuchProcess):
                command = " ".join(child.cmdline())[-200:]
                described += [f"{child.pid} {child.status()} {command}", *stack_of(child.pid)]
        return described

    def kill(self, wait: bool = True) -> None:
        """SIGKILL it, if it runs; `wait=False`: without waiting for it to be gone."""
        if self.process.poll() is None:
            self.process.kill()
            if wait:
                self.process.wait()

    def finish(self, timeout: float = 10) -> None:
        """Wait for its output to be read to the end (it has exited or been killed)."""
        self.process.wait(timeout)
        for reader in self._readers:
            reader.join(timeout)


def stack_of(pid: int) -> list[str]:
    """Where a Python process's threads are, from outside it (no signal it might not
    handle): py-spy's dump, or nothing when py-spy is missing or cannot attach."""
    spy = shutil.which(
        "py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    if spy is None:
        return []
    try:
        dump = subprocess.run(
            [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        return [f"  (py-spy dump of {pid} timed out)"]
    return ["  " + line for line in (dump.stdout or dump.stderr).splitlines()]


def wait_all(procs: list[Proc], timeout: float = 60) -> list[int]:
    """Every proc's exit code, all within one deadline. If some still run then, the
    error shows each of those: its last events, its children, where its threads are
    (one hung member or program keeps the others at their barrier: which one?)."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.process.wait(max(0.0, deadline - time.monotonic()))
    running = [proc for proc in procs if proc.process.poll() is None]
    if running:
        children = {proc: proc.children() for proc in running}
        # Those whose program still runs first (likely the culprit: a long report is cut).
        running.sort(key=lambda proc: not children[proc])
        report = [f"{len(running)} of {len(procs)} still running after {timeout}s"]
        for proc in running:
            report += [f"--- pid {proc.process.pid}: last events {proc.events[-3:]}",
                       "children:", *children[proc], "its last output:", *proc.stderr[-40:],
                       "its threads:", *proc.threads()]  # fmt: skip
        raise AssertionError("\n".join(report))
    return [proc.wait_exit(timeout=5) for proc in procs]


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
    """Command line of a test member that can stall before a phase (member_proc.py)."""
    args = [
        sys.executable, str(MEMBER_PROC), "--job", job,
        "--world-size", str(world_size), "--etcd", endpoint, "--namespace", namespace,
    ]  # fmt: skip
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def gone(pids: list[int]) -> bool:
    """Whether every one of `pids` has ended (a zombie counts as ended)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def unreachable_etcd(port: int = 1) -> str:
    """An etcd endpoint nothing answers at, in the scheme of the session's etcd: its TLS
    settings, in the environment once a test used it, go only with `https://`."""
    scheme = "https://" if os.environ.get("COORDINATOR_ETCD_CA") else ""
    return f"{scheme}127.0.0.1:{port}"
