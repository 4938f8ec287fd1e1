"""`serve --run-as-uids`: each job's programs run under a uid of their own, so a program
reads neither the service's etcd password nor its member's, and writes no other job's
artifacts (a real service as root, real members, real programs)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.service import ServiceProc, wait_state

pytestmark = [
    pytest.mark.one_etcd,
    pytest.mark.skipif(os.geteuid() != 0, reason="starting programs as other uids needs root"),
]
UIDS = "61000-61009"
# The programs' interpreter: one every uid may run (this venv's may live under /root).
PYTHON = shutil.which("python3", path="/usr/bin:/usr/local/bin") or sys.executable

PROBE = """
import json, os, socket, ssl, sys
def handshake(endpoint):  # etcd checks no user for alarms, leases, compaction: only TLS
    host, _, port = endpoint.removeprefix("https://").rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with context.wrap_socket(socket.create_connection((host, int(port)), 5)) as tls:
            tls.settimeout(5)
            tls.sendall(b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n")
            return "open" if tls.recv(1) else "refused"
    except (ssl.SSLError, ConnectionError):
        return "refused"
def tries(path, mode):
    try:
        with open(path, mode) as handle:
            handle.read() if mode == "r" else handle.write("x")
        return "opened"
    except OSError as exc:
        return type(exc).__name__
said = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "member_password": tries(os.environ.get("COORDINATOR_ETCD_PASSWORD_FILE", ""), "r"),
        "service_password": tries(sys.argv[1], "r"),
        "client_key": tries(sys.argv[2], "r"),
        "etcd": handshake(sys.argv[3]),
        "roster": tries(os.environ["COORDINATOR_ROSTER"], "r"),
        "own_artifacts": tries(os.path.join(os.environ["COORDINATOR_ARTIFACTS"], "m.txt"), "w")}
if len(sys.argv) > 4:
    said["other_artifacts"] = tries(os.path.join(sys.argv[4], "forged.txt"), "w")
print("PROBE " + json.dumps(said), flush=True)
"""


@pytest.fixture
def open_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Folders the programs' uids may enter (pytest's tmp_path is closed to others): the
    artifacts and working-dir roots, and the members' temporary folder."""
    root = Path(tempfile.mkdtemp(dir="/tmp"))
    for name in ("artifacts", "work", "tmp"):
        (root / name).mkdir()
    for folder in (root, *root.iterdir()):
        folder.chmod(0o711)
    monkeypatch.setenv("TMPDIR", str(root / "tmp"))
    yield root
    shutil.rmtree(root)


def probe(service: ServiceProc, job_id: str, *args: str) -> dict[str, object]:
    spec = {"id": job_id, "kind": "command", "workers": 2,
            "command": [PYTHON, "-c", PROBE, *args]}  # fmt: skip
    response = service.http.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    record = wait_state(service, job_id, {"SUCCEEDED", "FAILED"})
    assert record["state"] == "SUCCEEDED", record["conditions"]
    logs = service.http.get(f"/v1/jobs/{job_id}/logs").text
    said = [
        json.loads(line.split("PROBE ", 1)[1]) for line in logs.splitlines() if "PROBE " in line
    ]
    assert len(said) == 2, logs
    assert said[0]["uid"] == said[1]["uid"], said  # one uid per job on a host
    return dict(said[0])


def test_each_jobs_programs_run_under_a_uid_of_their_own_that_reaches_nothing_else(
    serve: Callable[..., ServiceProc], open_root: Path, etcd_server: Any
) -> None:
    service = serve(
        "--run-as-uids", UIDS, "--artifacts-root", str(open_root / "artifacts"),
        "--working-dir-root", str(open_root / "work"),
    )  # fmt: skip
    # The service's etcd is the session's: its root password, client key and endpoint.
    reach = [
        os.environ["COORDINATOR_ETCD_PASSWORD_FILE"],
        os.environ.get("COORDINATOR_ETCD_KEY", ""),
    ]
    reach.append(etcd_server.endpoint)
    first = probe(service, "first", *reach)
    assert first["uid"] in range(61000, 61010) and first["gid"] == first["uid"]
    assert first["groups"] in ([], [first["uid"]])  # none of the service's groups
    assert first["member_password"] in ("PermissionError", "FileNotFoundError")
    assert first["service_password"] == "PermissionError"
    assert first["roster"] == first["own_artifacts"] == "opened"
    if etcd_server.endpoint.startswith("https://"):  # the embedded etcd: no alarm, no lease calls
        assert first["client_key"] == "PermissionError" and first["etcd"] == "refused"
    (folder,) = (open_root / "artifacts").iterdir()
    assert folder.stat().st_uid == first["uid"] and folder.stat().st_mode & 0o777 == 0o700

    second = probe(service, "second", *reach, str(folder))
    assert second["uid"] != first["uid"]  # the next in turn, not the one just freed
    assert second["other_artifacts"] == "PermissionError"
    assert not (folder / "forged.txt").exists()


def test_run_as_needs_a_range_it_can_use(serve: Callable[..., ServiceProc], tmp_path: Path) -> None:
    import subprocess

    given = subprocess.run(
        [sys.executable, "-m", "coordinator", "serve", "--run-as-uids", "5-4",
         "--data-dir", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert given.returncode == 2 and "--run-as-uids" in given.stderr, given.stderr
