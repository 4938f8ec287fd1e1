"""What per-job etcd users cost at job start.

A job starts with a user of its own (made as root: role, grant, user, password
file; the members authenticate as it) against the same job started with root's
credentials passed through, in the same run, alternating, on one embedded etcd
with auth on. The time is from the start (before the user is made) to every
member past `connect`, as the service's RUNNING means it. Members are real
`coordinator worker` processes.

    python bench/security.py [--sizes 2,8] [--repeats 5]

Target: per-job users within +0.2 s of root's at N = 8.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.etcd.users import provision_job, revoke_job, write_password_file
from coordinator.launch import WorkerCommand

NAMESPACE = "/bench-security"


def _past_connect(process: subprocess.Popen[str], arrived: list[float]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "phase" and event.get("phase") == "connect":
            arrived.append(time.monotonic())
    process.wait()


def start_job(
    server: EmbeddedEtcd, admin: Etcd, workers: int, per_job: bool, folder: Path
) -> float:
    """Seconds from the start to every member past connect (the job is then let finish)."""
    job_id = f"bench-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    root = server.security
    user, password_file = root.user, root.password_file
    if per_job:
        credentials = provision_job(admin, job_id)
        user = credentials.user
        password_file = str(write_password_file(folder / job_id, credentials.password))
    command = WorkerCommand(
        job_id=job_id, world_size=workers, etcd=server.endpoint, namespace=NAMESPACE,
        kind="noop", timeout=60, etcd_user=str(user), etcd_password_file=str(password_file),
    )  # fmt: skip
    environment.update(command.env())
    args = command.process_argv()
    arrived: list[float] = []
    processes = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=environment)
        for _ in range(workers)
    ]  # fmt: skip
    readers = [threading.Thread(target=_past_connect, args=(p, arrived)) for p in processes]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(120)
    codes = [p.wait(30) for p in processes]
    if per_job:
        revoke_job(admin, job_id)
    if codes != [0] * workers or len(arrived) != workers:
        raise RuntimeError(f"job {job_id} failed: exit codes {codes}")
    return max(arrived) - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,8")
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    sizes = [int(n) for n in options.sizes.split(",")]
    with EmbeddedEtcd() as server, tempfile.TemporaryDirectory() as private:
        admin = Etcd(server.endpoint, namespace=NAMESPACE, security=server.security)
        start_job(server, admin, 2, True, Path(private))  # warm up: imports, first user
        print(f"{'N':>3} {'root (s)':>9} {'per-job (s)':>12} {'ratio':>6} {'diff (s)':>9}")
        for workers in sizes:
            times: dict[bool, list[float]] = {False: [], True: []}
            for repeat in range(options.repeats):
                for per_job in (repeat % 2 == 0, repeat % 2 != 0):  # alternate which goes first
                    times[per_job].append(start_job(server, admin, workers, per_job, Path(private)))
            root, own = statistics.median(times[False]), statistics.median(times[True])
            print(f"{workers:>3} {root:>9.3f} {own:>12.3f} {own / root:>6.2f} {own - root:>+9.3f}")
        admin.close()


if __name__ == "__main__":
    main()
