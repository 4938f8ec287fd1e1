"""Only what the service signed runs (issue 28, item 1): a job record or an assignment
written to etcd by anyone else (here: root, with a client of its own) is never acted
on, and is reported.

A real etcd with auth, a real `coordinator serve` and `coordinator agent` (which sign and
verify with the session's key pair, tests/support/signing.py), real member processes.
Each refusal has a positive control: the same value, signed with the service's key,
does run, so a test that passed because nothing ran at all would fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.service.model import JobRecord, JobSpec, JobState
from coordinator.service.placement.protocol import REGISTRATION, signed_assignment
from coordinator.signing import JOB, SIGNATURE, Signer, canonical
from tests.support.agents import as_the_service, registered
from tests.support.service import ServiceProc, wait_state
from tests.support.signing import session_signer
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd
STRANGER = Signer(Ed25519PrivateKey.generate())  # a key that is not the service's


def command_record(job_id: str, canary: Path) -> dict[str, Any]:
    """A PENDING `command` record whose one member would create `canary`."""
    program = [sys.executable, "-c", f"open({str(canary)!r}, 'w').write('ran')"]
    spec = JobSpec(id=job_id, kind="command", workers=1, command=program)
    record = JobRecord(
        id=job_id, uid=uuid.uuid4().hex, spec=spec, state=JobState.PENDING, conditions=[],
        submitted_at=time.time(),
    )  # fmt: skip
    return dict(json.loads(record.model_dump_json(exclude={SIGNATURE})))


def signed_by(signer: Signer, payload: dict[str, Any]) -> bytes:
    return canonical({**payload, SIGNATURE: signer.sign(JOB, payload)})


def test_a_command_record_written_as_root_without_the_services_signature_never_runs(
    serve: Callable[..., ServiceProc], etcd: Etcd, tmp_path: Path
) -> None:
    service = serve()
    canaries = {name: tmp_path / f"{name}.ran" for name in ("unsigned", "stranger", "changed")}
    changed = command_record("changed", canaries["changed"])
    changed_raw = json.loads(signed_by(session_signer(), command_record("changed", tmp_path / "x")))
    changed_raw["spec"] = changed["spec"]  # signed for another program, then changed
    forged: dict[str, bytes] = {
        "unsigned": json.dumps(command_record("unsigned", canaries["unsigned"])).encode(),
        "stranger": signed_by(STRANGER, command_record("stranger", canaries["stranger"])),
        "changed": json.dumps(changed_raw).encode(),
    }
    revisions = {}
    for job_id, raw in forged.items():  # root's client: etcd's permissions allow it all
        revisions[job_id] = etcd.put(etcd.key("api", "jobs", job_id), raw)
    # The positive control: the same kind of record, signed with the service's key, runs.
    control = tmp_path / "control.ran"
    etcd.put(
        etcd.key("api", "jobs", "control"),
        signed_by(session_signer(), command_record("control", control)),
    )
    assert wait_state(service, "control", {"SUCCEEDED", "FAILED"})["state"] == "SUCCEEDED"
    assert control.read_text() == "ran"
    # A job submitted after the forged ones runs too: the leader passed them by.
    spec = {"id": "after", "kind": "noop", "workers": 1, "params": {"seconds": 0}}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    assert wait_state(service, "after", {"SUCCEEDED"})["state"] == "SUCCEEDED"

    for job_id, canary in canaries.items():
        assert not canary.exists(), f"{job_id} ran"
        response = service.http.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 409, response.text  # the service reports it
        detail = response.json()["detail"]
        assert f"the stored record of job '{job_id}' is invalid: signature: " in detail
        kv = etcd.get(etcd.key("api", "jobs", job_id))
        assert kv is not None and kv.mod_revision == revisions[job_id]  # left alone, not signed
    causes = {"unsigned": "missing", "stranger": "does not verify", "changed": "does not verify"}
    for job_id, cause in causes.items():
        assert cause in service.http.get(f"/v1/jobs/{job_id}").json()["detail"]
    listed = [job["id"] for job in service.http.get("/v1/jobs").json()["jobs"]]
    assert listed == ["after", "control"]
    assert not any((service.data / "logs").glob("unsigned-*"))  # no member ever started
    log = service.output()
    for job_id in forged:  # logged once, however often the leader scanned
        key = etcd.key("api", "jobs", job_id)
        assert log.count(f"ignoring {key!r} (revision {revisions[job_id]}): signature: ") == 1


@pytest.mark.slow  # ~45 s on a loaded host: a job, a lost member, its restart
def test_every_version_the_service_writes_is_signed_through_a_jobs_life(
    serve: Callable[..., ServiceProc], etcd: Etcd
) -> None:
    """Submit, STARTING, RUNNING, a member's loss, the restart and the end: every version
    stored verifies, signed over all its fields."""
    service = serve()
    spec = {"id": "life", "kind": "noop", "workers": 2, "max_restarts": 1,
            "params": {"seconds": 4}}  # fmt: skip
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    running = wait_state(service, "life", {"RUNNING"})
    member = next(m for m in running["attempts"][0]["members"] if m["rank"] == 1)
    os.kill(member["pid"], signal.SIGKILL)
    final = wait_state(service, "life", {"SUCCEEDED"}, timeout=60)
    last = etcd.get(etcd.key("api", "jobs", "life"))
    assert last is not None
    versions: list[bytes] = []  # every version the key had, from its creation on
    watch = etcd.watch(
        last.key, lambda events: versions.extend(e.value for e in events), last.create_revision
    )
    try:
        wait_until(lambda: last.value in versions, 10, "the watch to replay the last version")
    finally:
        watch.cancel()
    states = set()
    for raw in versions:
        stored = json.loads(raw)
        payload = {k: v for k, v in stored.items() if k != SIGNATURE}
        session_signer().verify(JOB, payload, stored[SIGNATURE])  # raises if not
        states.add(stored["state"])
    assert {"PENDING", "STARTING", "RUNNING", "RESTARTING", "SUCCEEDED"} <= states, states
    assert final["signature"] == json.loads(last.value)[SIGNATURE]


def test_a_forged_assignment_is_refused_and_reported_by_the_agent(
    agents: Any, etcd: Etcd, etcd_server: EmbeddedEtcd
) -> None:
    agents("--id", "host-s", "--slots", "4")
    wait_until(lambda: registered(etcd, "host-s"), 30, "the agent to register")
    revision = etcd.get(etcd.key("agents", "host-s")).create_revision  # type: ignore[union-attr]

    def body(job: str) -> dict[str, Any]:
        args = ["--job", job, "--world-size", "1", "--etcd", etcd_server.endpoint,
                "--namespace", etcd.namespace]  # fmt: skip
        return {"run_id": f"{job}-0123", "attempt": 1, "index": 0, "worker_args": args}

    forged = {
        "unsigned": json.dumps({REGISTRATION: revision, **body("unsigned")}).encode(),
        "stranger": signed_assignment(
            STRANGER, "host-s", {REGISTRATION: revision, **body("stranger")}
        ),
        "elsewhere": signed_assignment(
            session_signer(), "host-x", {REGISTRATION: revision, **body("elsewhere")}
        ),
        "earlier": signed_assignment(
            session_signer(), "host-s", {REGISTRATION: revision - 1, **body("earlier")}
        ),
    }
    for job, value in forged.items():
        etcd.put(etcd.key("assignments", "host-s", f"{job}-0123-a1-m0"), value)
    etcd.put(
        etcd.key("assignments", "host-s", "control-0123-a1-m0"),
        as_the_service(etcd, "host-s", body("control")),
    )

    def report(job: str) -> dict[str, Any] | None:
        kv = etcd.get(etcd.key("reports", "host-s", f"{job}-0123-a1-m0"))
        found = json.loads(kv.value) if kv else None
        return found if found and found["state"] in ("exited", "refused") else None

    assert wait_until(lambda: report("control"), 60, "the signed member to run")["exit_code"] == 0
    reasons = {"unsigned": "missing", "stranger": "does not verify", "elsewhere": "does not verify",
               "earlier": f"placed on registration {revision - 1}"}  # fmt: skip
    for job, reason in reasons.items():
        refused = wait_until(lambda job=job: report(job), 30, f"{job} to be reported")
        assert refused["state"] == "refused", refused
        assert f"assignment {job}-0123-a1-m0 refused: signature: " in refused["reason"]
        assert reason in refused["reason"], refused
        assert refused.get("pid") is None  # never started
        assert etcd.get(etcd.key("assignments", "host-s", f"{job}-0123-a1-m0")) is None


def test_an_agent_without_the_services_key_does_not_start(
    etcd_server: EmbeddedEtcd, namespace: str, tmp_path: Path
) -> None:
    base = [sys.executable, "-m", "coordinator", "agent", "--etcd", etcd_server.endpoint,
            "--namespace", namespace, "--data-dir", str(tmp_path / "agent")]  # fmt: skip
    missing = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--service-key" in missing.stderr, missing.stderr
    not_a_key = tmp_path / "key.pub"
    not_a_key.write_text("hello")
    wrong = subprocess.run(
        [*base, "--service-key", str(not_a_key)], capture_output=True, text=True, timeout=60
    )
    said = " ".join(wrong.stderr.replace("│", " ").split())  # as rich wrapped it
    assert wrong.returncode == 2 and "not a PEM Ed25519 public key" in said, wrong.stderr
