"""A `command` program's reach, on a real `coordinator serve` (local launcher) and a real
etcd with auth on: from inside its job it tries etcd's cluster-wide calls, other leases
and other jobs' keys (issue 28, item 2), and each is refused; it holds no etcd setting
and finds no password in its environment or its ancestors' command lines."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyetcd import etcdrpc

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from tests.support.commands import PROGRAMS
from tests.support.service import ServiceProc, wait_state
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd


def program_report(service: ServiceProc, job: str) -> dict[str, Any] | None:
    logs = service.http.get(f"/v1/jobs/{job}/logs").text
    for line in logs.splitlines():
        _, _, text = line.partition("] ")
        if text.startswith('{"reach"'):
            return dict(json.loads(text))
    return None


def passwords(service: ServiceProc, etcd_server: EmbeddedEtcd) -> list[str]:
    """Every etcd password on the host that the test knows of: root's and the members'."""
    found = [etcd_server.security.password()]
    found += [p.read_text().strip() for p in service.data.glob("**/*.password")]
    return [p for p in found if p]


def test_a_program_reaches_nothing_beyond_its_job(
    serve: Callable[..., ServiceProc], etcd_server: EmbeddedEtcd, etcd: Etcd, tmp_path: Path
) -> None:
    service = serve()
    victim, granted_at = (
        etcd.grant_lease(60),
        time.monotonic(),
    )  # another job's lease, say a member's of job `other`
    etcd.put(etcd.key("jobs", "other", "secret"), "another job's", lease=victim)
    try:
        spec = {
            "id": "reach",
            "kind": "command",
            "workers": 1,
            "command": [sys.executable, str(PROGRAMS / "reach.py")],
            "env": {"VICTIM_LEASE": f"{victim:x}", "OTHER_JOB": "other",
                    "RELEASE_FILE": str(tmp_path / "release")},
        }  # fmt: skip
        response = service.http.post("/v1/jobs", json=spec)
        assert response.status_code == 201, response.text
        report = wait_until(lambda: program_report(service, "reach"), 90, "the program's report")
        secrets = passwords(service, etcd_server)  # (while the member runs: it has its file)
        (tmp_path / "release").touch()
        record = wait_state(service, "reach", {"SUCCEEDED", "FAILED"})
        assert record["state"] == "SUCCEEDED", record["conditions"]

        # Every call beyond the job is refused by the member's proxy.
        assert report["reach"] == dict.fromkeys(report["reach"], "PERMISSION_DENIED")
        assert len(report["reach"]) == 10
        # ... and etcd never saw them: no alarm, the victim's lease was not renewed
        # (its TTL only went down), nothing compacted.
        maintenance = etcdrpc.MaintenanceStub(etcd.calls_channel())
        alarms = maintenance.Alarm(etcdrpc.AlarmRequest(action=etcdrpc.AlarmRequest.GET))
        assert list(alarms.alarms) == []
        ttl = etcdrpc.LeaseStub(etcd.calls_channel()).LeaseTimeToLive(
            etcdrpc.LeaseTimeToLiveRequest(ID=victim)
        )
        elapsed = time.monotonic() - granted_at
        assert ttl.TTL + elapsed <= 61  # (never renewed since it was granted)

        # It holds no etcd setting, and its way to etcd is its member's socket.
        assert report["etcd_settings"] == []
        assert report["endpoint"].startswith("unix:/")
        # No password is in its environment, in a file its environment names, or in
        # the command lines of its reaper, member and service.
        assert len(secrets) >= 2  # root's and the member's (made for this job's user)
        named_files = [
            Path(value).read_text(errors="replace")
            for value in report["environ"].values()
            if value.startswith("/") and os.path.isfile(value)
        ]
        seen = json.dumps([report["environ"], report["cmdlines"], named_files])
        for secret in secrets:
            assert secret not in seen
        assert not any(value.endswith(".password") for value in report["environ"].values())
    finally:
        etcd.revoke_lease(victim)


@pytest.mark.skipif(os.geteuid() != 0, reason="starting programs as other uids needs root")
def test_a_program_under_its_own_uid_reaches_its_members_socket(
    serve: Callable[..., ServiceProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `--run-as-uids` the proxy's socket is the program's uid's (0600): it connects;
    the socket's folder lists nothing to it."""
    root = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        for name in ("artifacts", "tmp"):
            (root / name).mkdir()
        for folder in (root, *root.iterdir()):
            folder.chmod(0o711)
        monkeypatch.setenv("TMPDIR", str(root / "tmp"))
        service = serve("--run-as-uids", "61010-61019", "--artifacts-root", str(root / "artifacts"))
        # The system's python: this venv's may live where other uids cannot enter.
        python = shutil.which("python3", path="/usr/bin:/usr/local/bin") or sys.executable
        probe = (
            "import json, os, socket\n"
            "path = os.environ['COORDINATOR_ETCD'].removeprefix('unix:')\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect(path); said = 'connected'\n"
            "except OSError as exc:\n    said = type(exc).__name__\n"
            "try:\n    os.listdir(os.path.dirname(path)); listed = 'listed'\n"
            "except OSError as exc:\n    listed = type(exc).__name__\n"
            "print('PROBE ' + json.dumps({'uid': os.getuid(), 'socket': said, "
            "'folder': listed}), flush=True)\n"
        )
        spec = {"id": "own-uid", "kind": "command", "workers": 1, "command": [python, "-c", probe]}
        assert service.http.post("/v1/jobs", json=spec).status_code == 201
        record = wait_state(service, "own-uid", {"SUCCEEDED", "FAILED"})
        assert record["state"] == "SUCCEEDED", record["conditions"]
        logs = service.http.get("/v1/jobs/own-uid/logs").text
        (said,) = [json.loads(line.split("PROBE ", 1)[1]) for line in logs.splitlines()
                   if "PROBE " in line]  # fmt: skip
        assert said["uid"] in range(61010, 61020)
        assert said["socket"] == "connected" and said["folder"] == "PermissionError"
    finally:
        shutil.rmtree(root, ignore_errors=True)
