"""Members of the `command` kind for the tests: `coordinator ...` processes in sessions of
their own, the worker command line that runs a program, and the programs' results."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from tests.support.processes import piped, worker_args

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = Path(__file__).with_name("programs")  # the programs the members run
TTL, GRACE = 2, 2


class Run:
    """A `coordinator ...` process in a session of its own, its output lines collected."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.process = piped(
            [sys.executable, "-m", "coordinator", *args],
            {**os.environ, **(env or {})},
            ROOT,
            new_session=True,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            for stream, lines in (
                (self.process.stdout, self.stdout),
                (self.process.stderr, self.stderr),
            )
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        for reader in self._readers:  # every line read (they end with the pipes)
            reader.join(10)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def rank_results(lines: list[str]) -> dict[int, dict[str, Any]]:
    """The JSON result line each rank's program printed (prefixed `[rank N] ` by `run`)."""
    results = {}
    for line in lines:
        match = re.match(r"^(?:\[rank \d+\] )?(\{.*\})$", line)
        if match:
            result = json.loads(match.group(1))
            if "rank" in result and "event" not in result:
                results[result["rank"]] = result
    return results


def command_worker(
    etcd_server: EmbeddedEtcd, etcd: Etcd, job: str, world: int, program: list[str], **options: Any
) -> list[str]:
    args = worker_args(etcd_server.endpoint, etcd.namespace, job, world, kind="command", **options)
    return [*args, "--param", f"grace_seconds={GRACE}", "--", *program]
