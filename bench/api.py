"""REST service speed: status reads under load, and what a submit costs over `coordinator run`.

    python bench/api.py                                   # 5,000 reads per row, 5 runs of N=8
    python bench/api.py --requests 2000 --clients 100 --runs 3 --workers 8

Everything is real and on this machine's loopback: an embedded etcd, `coordinator serve`
as a subprocess (`--max-workers` = the run's N), `coordinator worker` processes.

1. **Reads.** `GET /v1/jobs/{id}` (a finished job's record, attempt and members
   included) from C concurrent clients in one process (asyncio, one keep-alive
   connection each, a closed loop: each sends its next request when the last is
   answered) for R requests: p50, p99 and requests/s. The baseline is `GET /healthz`
   under the same load from the same client: the floor of the framework (uvicorn,
   FastAPI) and of the client on this machine. Target: p99 < 50 ms at C = 100. A
   closed loop of C clients measures the most the service serves; its latency is then
   C / throughput (Little's law), whatever the service does. So the most clients also
   read paced, each every `--every` seconds (as clients polling a status do), timed
   from when each request was due, so that a late answer delays nothing unseen.
2. **Submit to running.** A noop job of N workers (`seconds` 0), through the service
   against `coordinator run noop --workers N` doing the same, alternating, median of
   the runs. *Running* is what the service calls RUNNING: every member passed the
   `connect` phase. Service: from sending the POST to the first record (its SSE
   stream) whose N members all show a phase past `connect`. Baseline: `coordinator
   run`'s own launcher (`coordinator.launch.piped.PipedLauncher`, the same worker
   arguments), in this process, from starting it to the N-th member's `connect` event
   on its stdout: `coordinator run` without its interpreter's start-up, which the
   service, already running, does not pay either. Also the whole run: to SUCCEEDED
   (members gone, keys cleared) against all members exited; and `coordinator run` as
   a process, start to exit, for reference. Target: the service's overhead < 0.5 s.
3. **Submits.** Throughput of `POST /v1/jobs` (noop, one worker, `seconds` 0) from C
   clients, with every slot held by a running job, so the submits stay queued and the
   figure is the API's and etcd's, not the members' start (they are cancelled after).
   It runs last: the records it leaves would slow the service's scans in part 2.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.etcd.server import EmbeddedEtcd
from coordinator.events import Exit, Phase
from coordinator.launch import WorkerCommand
from coordinator.launch.piped import PipedLauncher
from tests.support.service import ServiceProc, kill_members, wait_state
from tests.support.wait import WaitTimeout

console = Console(width=130)
PAST_CONNECT = {"connect", "training", "cleaner", "done"}  # a member's phase once connected
FINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
TARGET_P99_MS = 50.0
TARGET_OVERHEAD_S = 0.5
NAMESPACE = "/bench-api"  # the namespace of the service it starts


class Service(ServiceProc):
    """The tests' `coordinator serve` process (`tests/support/service.py`) serving NAMESPACE
    with `max_workers` slots, and what the benches ask of it besides: submits that must be
    new, and a stop that leaves no job and no member behind."""

    def __init__(self, endpoint: str, data: Path, max_workers: int, *extra: str) -> None:
        # --member-ttl 10: serve's default (the tests' 2 s would add lease renewals).
        super().__init__(endpoint, NAMESPACE, data, *extra, max_workers=max_workers, member_ttl=10)
        self.ready()
        # The token serve made (it has auth on unless --insecure): every client sends it.
        token = self.generated_token()
        Connection.authorization = f"Authorization: Bearer {token}\r\n" if token else ""

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post("/v1/jobs", json=spec)
        if response.status_code != 201:
            raise RuntimeError(f"submit {spec}: {response.status_code} {response.text}")
        return dict(response.json())

    def finish_everything(self) -> None:
        """Cancel every live job and wait until all are final (their members gone)."""
        jobs = self.http.get("/v1/jobs", params={"limit": 500}).json()["jobs"]
        for job in jobs:
            if job["state"] not in FINAL:
                self.http.post(f"/v1/jobs/{job['id']}/cancel")
        for job in jobs:
            wait_state(self, job["id"], FINAL, timeout=60)

    def stop(self) -> None:
        try:
            self.finish_everything()
        except (httpx.HTTPError, WaitTimeout) as exc:
            console.print(f"[yellow]could not finish the jobs cleanly: {exc}[/yellow]")
        super().stop()
        kill_members(self.data)  # any member still running


# -- 1. reads and 2. submits: a closed loop of concurrent clients ----------------------------


class Connection:
    """A minimal HTTP/1.1 keep-alive client on one asyncio connection: a few times the
    requests/s of httpx's AsyncClient here, where the client shares 2 cores with the server."""

    authorization = ""  # the header line every request carries (set once the service runs)

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Connection:
        host, port = url.removeprefix("http://").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        head = f"{method} {path} HTTP/1.1\r\nHost: bench\r\n{self.authorization}"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + (body or b""))
        status = int((await self.reader.readline()).split()[1])
        length = None
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            raise RuntimeError(f"{method} {path}: a response without Content-Length")
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


Send = Callable[[Connection, int], Awaitable[tuple[int, bytes]]]


async def _load(
    url: str, clients: int, requests: int, send: Send, every: float | None
) -> tuple[list[float], float]:
    """Latencies (seconds) of `requests` requests from `clients` concurrent clients, each on
    a connection of its own, and the wall time; `send(connection, n)` makes the n-th. A
    closed loop (`every` None: the next request as soon as the last is answered), or paced:
    each client sends one every `every` seconds (staggered), timed from when it was due."""
    connections = [await Connection.open(url) for _ in range(clients)]
    latencies: list[float] = []
    sent = 0
    start = time.perf_counter()

    async def one_client(index: int, connection: Connection) -> None:
        nonlocal sent
        due = start + (every or 0.0) * index / clients
        while sent < requests:
            n = sent
            sent += 1
            if every is not None:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))  # pacing, not syncing
            began = due if every is not None else time.perf_counter()
            status, body = await send(connection, n)
            latencies.append(time.perf_counter() - began)
            if status >= 300:
                raise RuntimeError(f"request {n}: {status} {body[:200]!r}")
            due += every or 0.0

    try:
        await asyncio.gather(*(one_client(i, c) for i, c in enumerate(connections)))
        return latencies, time.perf_counter() - start
    finally:
        for connection in connections:
            connection.close()


def load(
    url: str, clients: int, requests: int, send: Send, every: float | None = None
) -> dict[str, float]:
    latencies, wall = asyncio.run(_load(url, clients, requests, send, every))
    latencies.sort()
    return {
        "p50": latencies[len(latencies) // 2] * 1000,
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
        "rate": len(latencies) / wall,
    }


def reads(service: Service, job_id: str, clients: list[int], requests: int, every: float) -> Table:
    table = Table(title=f"reads: {requests} requests from C concurrent clients")
    columns = ["C", "load", "endpoint", "p50 ms", "p99 ms", "requests/s", "p99 / floor", "< 50"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("load", "endpoint") else "right")
    paths = {"GET /healthz (floor)": "/healthz", "GET /v1/jobs/{id}": f"/v1/jobs/{job_id}"}
    loads = [(c, None) for c in clients] + [(max(clients), every)]
    for c, pace in loads:
        figures: dict[str, dict[str, float]] = {}
        for name, path in paths.items():

            def get(connection: Connection, n: int, path: str = path) -> Any:
                return connection.request("GET", path)

            load(service.url, c, min(requests, 10 * c), get)  # warm the server up
            figures[name] = load(service.url, c, requests, get, pace)
            console.print(f"C={c} every={pace} {name}: {figures[name]}")
        floor = figures["GET /healthz (floor)"]["p99"]
        for name, f in figures.items():
            ok = "yes" if f["p99"] < TARGET_P99_MS else "[red]no[/red]"
            table.add_row(
                str(c), "closed loop" if pace is None else f"each every {pace:g} s", name,
                f"{f['p50']:.1f}", f"{f['p99']:.1f}", f"{f['rate']:.0f}",
                f"{f['p99'] / floor:.2f}x", ok if "floor" not in name else "-",
            )  # fmt: skip
    return table


def submits(service: Service, workers: int, clients: int, requests: int) -> Table:
    """POST throughput with every slot held, so nothing submitted starts meanwhile."""
    holder = f"hold-{uuid.uuid4().hex[:6]}"
    service.submit({"id": holder, "kind": "noop", "workers": workers, "params": {"seconds": 600}})
    wait_state(service, holder, {"RUNNING"}, timeout=120)
    run = uuid.uuid4().hex[:6]

    def post(connection: Connection, n: int) -> Any:
        spec = {"id": f"s-{run}-{n}", "kind": "noop", "workers": 1, "params": {"seconds": 0}}
        return connection.request("POST", "/v1/jobs", json.dumps(spec).encode())

    figures = load(service.url, clients, requests, post)
    table = Table(title=f"submits: {requests} POST /v1/jobs from {clients} clients (all queued)")
    for name in ["p50 ms", "p99 ms", "submits/s"]:
        table.add_column(name, justify="right")
    table.add_row(f"{figures['p50']:.1f}", f"{figures['p99']:.1f}", f"{figures['rate']:.0f}")
    console.print(f"submits: {figures}; cancelling them")
    service.finish_everything()
    return table


# -- 3. submit to running: the service against `coordinator run` ---------------------------


def through_service(service: Service, workers: int, launcher: str = "local") -> tuple[float, float]:
    """Seconds from the POST to every member past `connect`, and to SUCCEEDED, as the
    job's event stream shows them."""
    job_id = f"run-{uuid.uuid4().hex[:8]}"
    spec = {"id": job_id, "kind": "noop", "workers": workers, "params": {"seconds": 0},
            "launcher": launcher}  # fmt: skip
    began = time.perf_counter()
    service.submit(spec)
    running: float | None = None
    headers = {"Last-Event-ID": "0"}  # every version of the record since it was created
    with service.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data:"):
                continue
            record = json.loads(line[5:])
            members = record["attempts"][-1]["members"] if record["attempts"] else []
            passed = [m for m in members if m["phase"] in PAST_CONNECT]
            if running is None and len(passed) == workers:
                running = time.perf_counter() - began
            if record["state"] in FINAL:
                if record["state"] != "SUCCEEDED":
                    raise RuntimeError(f"{job_id}: {record['conditions'][-1]}")
                break
    ended = time.perf_counter() - began
    if running is None:
        raise RuntimeError(f"{job_id} ended without every member past connect")
    return running, ended


def through_launcher(endpoint: str, workers: int) -> tuple[float, float]:
    """The same through `coordinator run`'s launcher: seconds to the N-th `connect` event,
    and to every member's exit."""
    job_id = f"run-{uuid.uuid4().hex[:8]}"
    command = WorkerCommand(
        job_id=job_id,
        world_size=workers,
        etcd=endpoint,
        kind="noop",
        namespace="/bench-run",
        ttl=10,
        timeout=300,
        connect_timeout=10,
        params={"seconds": "0"},
    )  # fmt: skip  (what `coordinator run` gives its workers)
    began = time.perf_counter()
    launcher = PipedLauncher(workers, command)
    try:
        connected, exited, running = 0, 0, None
        deadline = time.monotonic() + 120
        while exited < workers:
            _, event = launcher.events.get(timeout=max(0.0, deadline - time.monotonic()))
            if isinstance(event, Phase) and event.phase == "connect":
                connected += 1
                if connected == workers:
                    running = time.perf_counter() - began
            elif isinstance(event, Exit):
                exited += 1
                if event.exit_code != 0:
                    raise RuntimeError(f"a worker exited {event.exit_code}")
        ended = time.perf_counter() - began
    finally:
        launcher.stop()
    if running is None:
        raise RuntimeError("the workers ended without all passing connect")
    return running, ended


def through_cli(endpoint: str, workers: int) -> float:
    """`coordinator run noop --workers N` as a process: seconds from start to exit."""
    began = time.perf_counter()
    args = [
        sys.executable, "-m", "coordinator", "run", "noop", "--workers", str(workers),
        "--etcd", endpoint, "--namespace", "/bench-cli", "--param", "seconds=0",
    ]  # fmt: skip
    subprocess.run(
        args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120
    )
    return time.perf_counter() - began


def startup(service: Service, endpoint: str, workers: int, runs: int) -> Table:
    ours: list[tuple[float, float]] = []
    theirs: list[tuple[float, float]] = []
    cli: list[float] = []
    for n in range(runs):
        ours.append(through_service(service, workers))
        theirs.append(through_launcher(endpoint, workers))
        cli.append(through_cli(endpoint, workers))
        console.print(
            f"run {n + 1}: service {ours[-1][0]:.3f}/{ours[-1][1]:.3f}s, "
            f"coordinator run {theirs[-1][0]:.3f}/{theirs[-1][1]:.3f}s (process {cli[-1]:.3f}s)"
        )
    table = Table(title=f"noop, N={workers} workers: seconds (median of {runs} runs, alternating)")
    for name in ["to", "service", "coordinator run", "overhead", "ratio", "overhead < 0.5 s"]:
        table.add_column(name, justify="left" if name == "to" else "right")
    for index, what in enumerate(["all members past connect", "the end (SUCCEEDED / exited)"]):
        s = statistics.median(r[index] for r in ours)
        t = statistics.median(r[index] for r in theirs)
        ok = "yes" if s - t < TARGET_OVERHEAD_S else "[red]no[/red]"
        table.add_row(what, f"{s:.3f}", f"{t:.3f}", f"{s - t:+.3f}", f"{s / t:.2f}x", ok)
    table.add_row(
        "the end, `coordinator run` as a process", "", f"{statistics.median(cli):.3f}", "", "", ""
    )
    return table


def main(
    requests: int = typer.Option(5_000, min=100, help="requests per read row"),
    clients: str = typer.Option("10,100", help="concurrent clients for the reads"),
    every: float = typer.Option(1.0, help="paced reads: each of the most clients every so often"),
    submit_requests: int = typer.Option(1_000, min=10, help="submits to time"),
    submit_clients: int = typer.Option(100, min=1, help="concurrent clients for the submits"),
    workers: int = typer.Option(8, min=1, help="N: members of the timed noop jobs"),
    runs: int = typer.Option(5, min=1, help="runs of each side for the time to running"),
) -> None:
    console.print(f"load average: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores")
    tables: list[Table] = []
    with EmbeddedEtcd() as server, tempfile.TemporaryDirectory(prefix="bench-api-") as data:
        server.security.export()  # its root's settings (auth is on): serve inherits them
        service = Service(server.endpoint, Path(data) / "service", max_workers=workers)
        try:
            finished = service.submit({"kind": "noop", "workers": 1, "params": {"seconds": 0}})
            wait_state(service, finished["id"], {"SUCCEEDED"}, timeout=120)
            counts = [int(c) for c in clients.split(",")]
            tables.append(reads(service, finished["id"], counts, requests, every))
            tables.append(startup(service, server.endpoint, workers, runs))
            tables.append(submits(service, workers, submit_clients, submit_requests))
        finally:
            service.stop()
    for table in tables:
        console.print(table)
    console.print(
        "floor: GET /healthz, the same client and load (framework and client on this machine). "
        "overhead = service - `coordinator run`'s launcher; ratio = service / launcher."
    )


if __name__ == "__main__":
    typer.run(main)
