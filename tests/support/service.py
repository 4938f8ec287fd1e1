"""`coordinator serve` as a process of its own for the tests and bench scripts (the one
helper of both): start it, talk to it, follow a job, and kill every member it started."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.support.wait import wait_until

READ_TOKEN = "reader-token-0123456789"
SUBMIT_TOKEN = "submitter-token-0123456789"


def free_port() -> int:
    """A loopback port free now, for the service to listen on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServiceProc:
    """`coordinator serve` as a process of its own, and an HTTP client for it; the client
    sends the token the service made (`<data>/api-token`) when it made one."""

    def __init__(
        self,
        endpoint: str,
        namespace: str,
        data: Path,
        *extra: str,
        max_workers: int = 4,
        member_ttl: int = 2,
    ) -> None:
        self.port = free_port()
        self.data = data
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable, "-m", "coordinator", "serve", "--port", str(self.port),
            "--namespace", namespace, "--data-dir", str(data), "--max-workers", str(max_workers),
            "--grace", "3", "--member-ttl", str(member_ttl), *extra,
        ]  # fmt: skip
        if endpoint:  # else the service's own etcd, in `data`
            args += ["--etcd", endpoint]
        self.log = open(data.with_suffix(".log"), "ab")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def ready(self) -> ServiceProc:
        def answers() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"serve exited {self.process.returncode}: {self.output()}")
            try:
                return self.http.get("/healthz").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(answers, 60, "the service to answer")
        if self.generated_token() is not None:
            self.http.headers["Authorization"] = f"Bearer {self.generated_token()}"
        return self

    def generated_token(self) -> str | None:
        """The exec token of `<data>/api-token`, which serve makes without --token-file."""
        path = self.data / "api-token"
        if not path.exists():
            return None
        return next(
            line.split()[1]
            for line in path.read_text().splitlines()
            if line.startswith(("exec ", "submit "))
        )

    def dashboard_link(self) -> str:
        """The link serve printed (with its token in the fragment, where it made one)."""
        found = re.search(r"dashboard: (\S+)", self.output())
        assert found, f"serve printed no dashboard link: {self.output()}"
        return found.group(1)

    def output(self) -> str:
        return self.data.with_suffix(".log").read_text(errors="replace")[-3000:]

    def job(self, job_id: str) -> dict[str, Any]:
        """The job's record; an HTTP error for a refusal (no such job, no token)."""
        response = self.http.get(f"/v1/jobs/{job_id}")
        response.raise_for_status()
        return dict(response.json())

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.http.close()
        self.log.close()


def kill_members(data: Path) -> None:
    """Kill every member a service started from `data` (their process groups)."""
    for pidfile in data.glob("logs/*/*/member-*.pid"):
        identity = json.loads(pidfile.read_text())
        try:
            process = psutil.Process(identity["pid"])
            if abs(process.create_time() - identity["started"]) < 0.05:
                os.killpg(identity["pid"], signal.SIGKILL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass


def wait_state(
    service: ServiceProc, job_id: str, states: set[str], timeout: float = 90
) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        record = service.http.get(f"/v1/jobs/{job_id}").json()
        return record if record["state"] in states else None

    return wait_until(reached, timeout, f"job {job_id} to be {states}")


def sse(service: ServiceProc, job_id: str, last: str | None = None, limit: int | None = None):
    """(id, record) of the events stream, up to `limit` events or the stream's end."""
    headers = {"Last-Event-ID": last} if last else {}
    got: list[tuple[str, dict[str, Any]]] = []
    with service.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
        assert response.status_code == 200
        event: dict[str, str] = {}
        for line in response.iter_lines():
            if line.startswith(("id:", "event:", "data:")):
                name, _, value = line.partition(":")
                event[name] = value.strip()
            elif not line and "data" in event:
                got.append((event["id"], json.loads(event["data"])))
                event = {}
                if limit is not None and len(got) == limit:
                    break
    return got


def no_member_runs(record: dict[str, Any]) -> bool:
    for attempt in record["attempts"]:
        for member in attempt["members"]:
            try:
                process = psutil.Process(member["pid"])
                if process.status() != psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                pass
    return True
