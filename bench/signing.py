"""What signing job records and assignments costs a job's start: this checkout against a
baseline checkout (a worktree of main before signing), in the same run.

    python bench/signing.py --baseline /work/main            # N = 2 and 8, 7 runs each
    python bench/signing.py --baseline /work/main --sizes 2,8 --runs 9 --launcher agents
    python bench/signing.py --baseline ../base --own-etcd    # each side its own etcd too

With `--own-etcd` (local launcher), each service starts its own embedded etcd, as
`serve` alone does, so the comparison is of the whole start: this checkout's etcd with
its client certificate and peer socket, its signed records, pids cgroups and members'
etcd proxies, against the baseline's.

One embedded etcd (auth on, as the product runs it); one `coordinator serve` from each
checkout, side by side on it (namespaces of their own, `--max-workers` = the largest N),
each with its members' code from its own checkout (PYTHONPATH). With `--launcher
agents`, each service gets two `coordinator agent`s of its own checkout (ours with the
service's public key), so assignments are signed and verified too.

A run submits a noop job of N workers (`seconds` 0) to one service, then the same to
the other, alternating which goes first; it times from just before the POST to the
moment the service recorded RUNNING (every member passed `connect`: the RUNNING
condition's `at`, taken on this machine's clock), and waits for the end before the
next. Printed per N: the median start of each side, and the median of the per-pair
ratios ours / baseline. Target: within 10 % (ratio <= 1.10).

Only loopback is contacted; every process started is stopped by its pid at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.etcd.server import EmbeddedEtcd  # noqa: E402
from coordinator.signing import data_dir_key  # noqa: E402
from tests.support.service import free_port, stop_service_etcd  # noqa: E402
from tests.support.wait import wait_until  # noqa: E402


class Side:
    """One checkout's service (and agents), reached over HTTP."""

    def __init__(self, name: str, tree: Path, endpoint: str, work: Path, args: argparse.Namespace):
        self.name, self.tree = name, tree
        self.signed = tree.resolve() == ROOT
        self.env = {**os.environ, "PYTHONPATH": str(tree)}
        self.data = work / name
        self.data.mkdir()
        namespace = f"/bench-{name}-{uuid.uuid4().hex[:6]}"
        self.port = free_port()
        own = ["--etcd", endpoint] if not args.own_etcd else []
        serve = [
            sys.executable, "-m", "coordinator", "serve", *own,
            "--namespace", namespace, "--port", str(self.port), "--data-dir", str(self.data),
            "--max-workers", str(max(args.sizes)), "--member-ttl", "5",
            "--member-connect-timeout", "60",  # a loaded host starts 8 members slowly
            "--default-launcher", args.launcher,
        ]  # fmt: skip
        if self.signed:  # its key made before, so the agents can be given its public half
            data_dir_key(self.data)
            serve += ["--signing-key", str(self.data / "signing-key")]
        self.processes = [self._start(serve, "serve")]
        if args.launcher == "agents":
            for n in range(2):
                agent = [
                    sys.executable, "-m", "coordinator", "agent", "--etcd", endpoint,
                    "--namespace", namespace, "--id", f"{name}-{n}",
                    "--slots", str(max(args.sizes)), "--data-dir", str(self.data / f"agent-{n}"),
                ]  # fmt: skip
                if self.signed:
                    agent += ["--service-key", str(self.data / "signing-key.pub")]
                self.processes.append(self._start(agent, f"agent-{n}"))
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)

    def _start(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.data.with_name(f"{self.name}-{name}.log"), "wb")  # noqa: SIM115
        return subprocess.Popen(
            args, cwd=self.tree, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def ready(self) -> None:
        def answers() -> bool:
            if self.processes[0].poll() is not None:
                raise SystemExit(f"{self.name}: serve exited {self.processes[0].returncode}")
            try:
                return self.http.get("/healthz").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(answers, 120, f"{self.name}'s service to answer")
        token = next(
            line.split()[1]
            for line in (self.data / "api-token").read_text().splitlines()
            if line.startswith(("exec ", "submit "))
        )
        self.http.headers["Authorization"] = f"Bearer {token}"

    def start_seconds(self, workers: int, launcher: str) -> float:
        """From just before the POST to the RUNNING the service recorded; waits for the end."""
        job = f"b-{uuid.uuid4().hex[:10]}"
        spec = {"id": job, "kind": "noop", "workers": workers, "params": {"seconds": 0},
                "launcher": launcher}  # fmt: skip
        before = time.time()
        response = self.http.post("/v1/jobs", json=spec)
        assert response.status_code == 201, response.text

        def ended() -> dict[str, Any] | None:
            record = self.http.get(f"/v1/jobs/{job}").json()
            return record if record["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None

        record = wait_until(ended, 300, f"{self.name}'s job {job} to end", every=0.1)
        assert record["state"] == "SUCCEEDED", record
        running = next(c["at"] for c in record["conditions"] if c["state"] == "RUNNING")
        return float(running - before)

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.http.close()
        stop_service_etcd(self.data)  # with --own-etcd: it outlives the service


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of main")
    parser.add_argument("--sizes", default="2,8", help="N: workers of the timed jobs")
    parser.add_argument("--runs", type=int, default=7, help="pairs per N")
    parser.add_argument("--launcher", choices=["local", "agents"], default="local")
    parser.add_argument(
        "--own-etcd", action="store_true", help="each service its own etcd (local launcher)"
    )
    args = parser.parse_args()
    if args.own_etcd and args.launcher != "local":
        raise SystemExit("--own-etcd: with the local launcher only")
    args.sizes = [int(n) for n in args.sizes.split(",")]
    if not (args.baseline / "coordinator").is_dir() or args.baseline.resolve() == ROOT:
        raise SystemExit(f"--baseline {args.baseline}: not another checkout of the project")
    with tempfile.TemporaryDirectory(prefix="bench-signing-") as folder, EmbeddedEtcd() as etcd:
        if not args.own_etcd:
            etcd.security.export()  # both services and their members log in as root
        sides = [
            Side("signed", ROOT, etcd.endpoint, Path(folder), args),
            Side("baseline", args.baseline, etcd.endpoint, Path(folder), args),
        ]
        try:
            for side in sides:
                side.ready()
            for side in sides:  # a warm-up job each: imports cached, first user made
                side.start_seconds(min(args.sizes), args.launcher)
            print(f"job start, submit to RUNNING ({args.launcher} launcher, {args.runs} pairs)")
            print(f"{'N':>3} {'signed s':>9} {'baseline s':>11} {'ratio':>7}  (medians)")
            for workers in args.sizes:
                times: dict[str, list[float]] = {"signed": [], "baseline": []}
                ratios = []
                for run in range(args.runs):
                    order = sides if run % 2 == 0 else sides[::-1]
                    pair = {side.name: side.start_seconds(workers, args.launcher) for side in order}
                    for name, seconds in pair.items():
                        times[name].append(seconds)
                    ratios.append(pair["signed"] / pair["baseline"])
                print(
                    f"{workers:>3} {statistics.median(times['signed']):>9.3f} "
                    f"{statistics.median(times['baseline']):>11.3f} "
                    f"{statistics.median(ratios):>7.3f}",
                    flush=True,
                )
        finally:
            for side in sides:
                side.stop()


if __name__ == "__main__":
    main()
