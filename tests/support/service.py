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

from tests.support.cgroups import remove_member_cgroups
from tests.support.signing import key_files
from tests.support.wait import wait_until

READ_TOKEN = "reader-token-0123456789"
SUBMIT_TOKEN = "submitter-token-0123456789"
EXEC_TOKEN = "executor-token-0123456789"


def free_port() -> int:
    """A loopback port free now, for the service to listen on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServiceProc:
    """`coordinator serve` as a process of its own, and an HTTP client for it. Unless told
    otherwise (`--token-file`, `--insecure`, `exec_token=False`) the service is given an
    exec token file of the test's, `<data>/api-token`, where the CLI finds it (serve would
    make only a submit token there); the client sends the token of that file."""

    def __init__(
        self,
        endpoint: str,
        namespace: str,
        data: Path,
        *extra: str,
        max_workers: int = 4,
        member_ttl: int = 2,
        exec_token: bool = True,
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
        if "--signing-key" not in extra:  # the session's: its agents and tests verify it
            args += ["--signing-key", str(key_files()[0])]
        self.token_file = data / "api-token"  # where the CLI finds a token by itself too
        if exec_token and not {"--token-file", "--insecure"} & set(extra):
            data.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.token_file.write_text(f"exec {EXEC_TOKEN}\n")
            self.token_file.chmod(0o600)
            args += ["--token-file", str(self.token_file)]
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
        """The token of `<data>/api-token`: the test's exec token, or the submit token serve
        made there with `exec_token=False`."""
        path = self.token_file
        if not path.exists():
            return None
        return next(
            line.split()[1]
            for line in path.read_text().splitlines()
            if line.startswith(("exec ", "submit "))
        )

    def dashboard_link(self) -> str:
        """The link serve printed, with the client's token in the fragment (serve puts it
        there only on a terminal)."""
        found = re.search(r"dashboard: (\S+)", self.output())
        assert found, f"serve printed no dashboard link: {self.output()}"
        token = self.generated_token()
        link = found.group(1)
        return f"{link}#token={token}" if token and "#" not in link else link

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
    remove_member_cgroups(data / "logs")


def stop_service_etcd(data: Path) -> None:
    """Stop the etcd a service started in `data`: it outlives the service, by design."""
    try:
        record = json.loads((data / "etcd.json").read_text())
        process = psutil.Process(record["pid"])
        if abs(process.create_time() - record["started"]) < 0.05:
            process.kill()
            process.wait(10)
    except (OSError, ValueError, psutil.Error):
        pass


def simulation_processes(pid: int) -> list[psutil.Process]:
    """The service's simulation processes (spawned interpreters: `multiprocessing.spawn`;
    not its resource tracker, which lives as long as the service)."""
    found = []
    for process in psutil.Process(pid).children():
        try:
            if "multiprocessing.spawn" in " ".join(process.cmdline()):
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


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
