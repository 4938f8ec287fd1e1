"""The service trusts nothing it reads from etcd: forged job records written straight into
etcd never make it signal a process that is not its member, read a file outside its logs
folder, delete anything outside it, or answer a 500; invalid records are named and left
alone while other jobs go on.

A real etcd, a real `coordinator serve` (tests/support/service.py), real member
processes, and a real bystander process: a child of the test, in a session of its own (as
a member is), that blocks SIGTERM so a SIGTERM sent to it stays visible as pending, and
answers SIGUSR1 with a line, which it could not do after a SIGKILL.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from coordinator.etcd.client import Etcd
from coordinator.launch import WorkerCommand
from coordinator.service import store as job_store
from coordinator.service.launchers import VANISHED, Launch
from coordinator.service.launchers.local import LocalLauncher
from coordinator.service.model import JobRecord, JobSpec, JobState, Member
from coordinator.service.store import InvalidRecord, JobStore
from coordinator.signing import JOB, SIGNATURE, canonical
from tests.support.service import ServiceProc, wait_state
from tests.support.signing import session_signer
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd
SIGTERM_BIT = 1 << (signal.SIGTERM - 1)
BYSTANDER = (
    "import signal, sys\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
    "signal.signal(signal.SIGUSR1, lambda *_: print('alive', flush=True))\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    signal.pause()\n"
)


class Bystander:
    """A process that is nobody's member: it must never get a signal from the service."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", BYSTANDER],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # a process group of its own, as a member has
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline() == "ready\n"
        self.pid = self.process.pid
        self.started = psutil.Process(self.pid).create_time()

    def got_sigterm(self) -> bool:
        """A SIGTERM was sent to it (blocked, so still pending)."""
        pending = 0
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")):
                pending |= int(line.split()[1], 16)
        return bool(pending & SIGTERM_BIT)

    def answers(self) -> bool:
        """It still runs its own code: no SIGKILL reached it before this ping."""
        assert self.process.stdout is not None
        self.process.send_signal(signal.SIGUSR1)
        return self.process.stdout.readline() == "alive\n"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
def bystanders() -> Iterator[Callable[[], Bystander]]:
    started: list[Bystander] = []

    def start() -> Bystander:
        started.append(Bystander())
        return started[-1]

    yield start
    for bystander in started:
        bystander.stop()


def record(job_id: str, workers: int = 2, **fields: Any) -> dict[str, Any]:
    """A valid job record as JSON-ready data, with `fields` replaced."""
    spec = JobSpec(id=job_id, kind="noop", workers=workers)
    now = time.time()
    valid = JobRecord(
        id=job_id,
        uid=uuid.uuid4().hex,
        spec=spec,
        state=JobState.PENDING,
        conditions=[],
        submitted_at=now,
    )
    return {**valid.model_dump(mode="json"), **fields}


def running(job_id: str, members: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """A record of a local job (RUNNING unless `fields` say) whose attempt 1 has `members`."""
    attempt = {"number": 1, "started_at": time.time(), "members": members}
    fields = {"state": "RUNNING", "attempts": [attempt], **fields}
    return record(job_id, workers=len(members), **fields)


def signed(data: dict[str, Any]) -> bytes:
    """`data` signed with the service's key: as if a forger held it, so what is tested here
    is the validation behind the signature (tests/system/test_signed_records.py: without it)."""
    payload = {key: value for key, value in data.items() if key != SIGNATURE}
    return canonical({**payload, SIGNATURE: session_signer().sign(JOB, payload)})


def write(etcd: Etcd, job_id: str, value: dict[str, Any] | str) -> int:
    """Put a record at the job's key (signed), as any writer of etcd with the service's
    key could; its revision."""
    text = value if isinstance(value, str) else signed(value)
    return etcd.put(etcd.key("api", "jobs", job_id), text)


def stored_revision(etcd: Etcd, job_id: str) -> int:
    kv = etcd.get(etcd.key("api", "jobs", job_id))
    assert kv is not None
    return kv.mod_revision


# -- the validators on their own ------------------------------------------------------------


def as_raw(data: dict[str, Any]) -> bytes:
    return signed(data)


def parse_record(job_id: str, raw: bytes) -> JobRecord:
    return job_store.parse_record(job_id, raw, session_signer().public)


def with_member(**fields: Any) -> dict[str, Any]:
    member = {"index": 0, "pid": 4242, "started": 1.0, **fields}
    return running("forged", [member, {"index": 1, "pid": 4243, "started": 1.0}])


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (record("forged", uid="../../" + "0" * 26), "uid"),
        (record("forged", uid="0/" + "0" * 30), "uid"),
        (record("forged", uid="Z" * 32), "uid"),
        (record("forged", id="Forged_ID"), "id: String should match pattern"),
        (record("forged", spec={**record("forged")["spec"], "workers": "2"}), "spec.workers"),
        (record("forged", submitted_at="1700000000"), "submitted_at"),
        (record("forged", surprise=1), "surprise"),
        (record("forged", spec={**record("forged")["spec"], "id": "other"}), "spec.id"),
        (with_member(pid=0), "pid"),
        (with_member(pid=-1), "pid"),
        (with_member(pid="4242"), "pid"),
        (with_member(pid=True), "pid"),
        (with_member(index=2), "index 2 is out of range for 2 workers"),
        (with_member(index=-1), "index"),
        (with_member(rank=7), "rank 7 is out of range"),
        (with_member(exit_code=1000), "exit_code"),
        (with_member(pid=None, container="a" * 64), "found by its pid"),
        (with_member(container="../../containers/x"), "container"),
        (
            running("forged", [{"index": 0, "pid": 1, "started": 1.0}] * 2),
            "index recorded twice",
        ),
        (
            {**with_member(), "attempts": [with_member()["attempts"][0]] * 2},
            "2 attempts, but max_restarts 0 allows 1",
        ),
        (
            {**with_member(), "attempts": [{**with_member()["attempts"][0], "number": 3}]},
            "attempt 1 says it is number 3",
        ),
    ],
)
def test_a_forged_record_fails_validation_naming_the_field(
    data: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidRecord, match="the stored record of job 'forged' is invalid") as err:
        parse_record("forged", as_raw(data))
    assert named in err.value.cause


def test_records_of_other_launchers_name_only_their_own_members() -> None:
    docker = record("d", state="RUNNING")
    docker["spec"]["launcher"] = "docker"
    docker["attempts"] = [{"number": 1, "started_at": 1.0, "members": [{"index": 0}]}]
    with pytest.raises(InvalidRecord, match="container id"):
        parse_record("d", as_raw(docker))
    docker["attempts"][0]["members"] = [{"index": 0, "container": "f" * 64}]
    assert parse_record("d", as_raw(docker)).attempts[0].members[0].log is None

    agents = record("g", state="RUNNING")
    agents["spec"]["launcher"] = "agents"
    run_id = f"g-{agents['uid'][:8]}"
    other = {"index": 0, "assignment": "host-a/someone-else-12345678-a1-m0"}
    agents["attempts"] = [{"number": 1, "started_at": 1.0, "members": [other]}]
    with pytest.raises(InvalidRecord, match="agents member"):
        parse_record("g", as_raw(agents))
    agents["attempts"][0]["members"] = [{"index": 0, "assignment": f"host-a/{run_id}-a1-m0"}]
    parse_record("g", as_raw(agents))


def test_a_record_under_another_jobs_key_and_garbage_are_refused() -> None:
    with pytest.raises(InvalidRecord, match="another job's key"):
        parse_record("victim", as_raw(record("forged")))
    with pytest.raises(InvalidRecord, match="signature: not JSON"):
        parse_record("forged", b"{not json")
    with pytest.raises(InvalidRecord, match="submitted_at: Input should be a finite number"):
        parse_record("forged", as_raw(record("forged", submitted_at=float("nan"))))


def test_a_stored_log_path_is_replaced_by_the_one_derived_from_the_record() -> None:
    data = with_member(log="/etc/passwd")
    data["attempts"][0]["members"][1]["log"] = "../../api-token"
    parsed = parse_record("forged", as_raw(data))
    run_id = parsed.run_id
    assert [m.log for m in parsed.attempts[0].members] == [
        f"{run_id}/attempt-1/member-0.log",
        f"{run_id}/attempt-1/member-1.log",
    ]


# -- the local launcher with real processes ------------------------------------------------


def test_the_local_launcher_signals_only_the_processes_it_started(
    tmp_path: Path, etcd: Etcd, etcd_server: Any, bystanders: Callable[[], Bystander]
) -> None:
    launcher = LocalLauncher(tmp_path / "logs")
    spec = JobSpec(id="solo", kind="noop", workers=2)
    command = WorkerCommand(
        job_id="solo", world_size=2, etcd=etcd_server.endpoint, namespace=etcd.namespace, ttl=2
    )
    member = launcher.start(Launch("solo-0123abcd", 1, spec, command), 0)  # waits for a peer
    bystander = bystanders()
    log = str(tmp_path / "logs" / "solo-0123abcd" / "attempt-1" / "member-0.log")
    forgeries = [
        Member(index=0, pid=bystander.pid, started=None, log=log),
        Member(index=0, pid=bystander.pid, started=bystander.started + 5, log=log),
        Member(index=0, pid=bystander.pid, started=bystander.started, log=log),  # exact time
        Member(index=0, pid=bystander.pid, started=bystander.started, log=None),
        member.model_copy(update={"pid": bystander.pid, "started": bystander.started}),
    ]
    try:
        for forged in forgeries:
            launcher.terminate(forged)
            launcher.kill(forged)
            assert launcher.exit_code(forged) is not None  # not ours: never "running"
        assert not bystander.got_sigterm()
        assert bystander.answers()
        # The member it started is signalled: the checks above could have failed.
        assert launcher.exit_code(member) is None
        launcher.terminate(member)
        code = wait_until(lambda: launcher.exit_code(member), 30, "the member to leave")
        assert code in (130, 128 + signal.SIGTERM)  # it left, or died of the SIGTERM
    finally:
        launcher.kill(member)


def test_the_local_launcher_reads_and_removes_only_under_its_logs_folder(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    secret = tmp_path / "api-token"
    secret.write_text("submit the-secret-token\n")
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep").write_text("keep me")
    (logs / "job-").mkdir(parents=True)  # so that `job-/../..` would resolve
    launcher = LocalLauncher(logs)
    for path in [str(secret), "../api-token", "job-0123abcd/attempt-1/../../../api-token",
                 f"{logs}/../api-token"]:  # fmt: skip
        assert launcher.output(Member(index=0, pid=1, log=path), 0) == b""
    (logs / "job-0123abcd").symlink_to(tmp_path)  # a link out of the logs folder
    member = Member(index=0, pid=1, log="job-0123abcd/attempt-1/member-0.log")
    (tmp_path / "attempt-1").mkdir()
    (tmp_path / "attempt-1" / "member-0.log").write_text("outside")
    assert launcher.output(member, 0) == b""
    for run_id in ["job-/../../canary", "../canary", "", ".", "..", "job-0123abcd"]:
        with pytest.raises(ValueError):
            launcher.remove(run_id)
    assert (canary / "keep").read_text() == "keep me"
    assert (logs / "job-").is_dir()


# -- forged records against a running service ------------------------------------------------


def test_a_forged_record_naming_a_bystander_never_gets_it_signalled(
    serve: Callable[..., ServiceProc],
    etcd: Etcd,
    bystanders: Callable[[], Bystander],
) -> None:
    service = serve()
    bystander = bystanders()
    members = [
        {"index": 0, "pid": bystander.pid, "started": None},
        {"index": 1, "pid": bystander.pid, "started": bystander.started + 3.0},
        {"index": 2, "pid": bystander.pid, "started": bystander.started},  # copied exactly
    ]
    forged = running("forged", members, cancel_requested_at=time.time())
    write(etcd, "forged", forged)
    final = wait_state(service, "forged", {"CANCELLED"}, timeout=60)
    # Not its members: they read as gone at once, without a signal (nor a grace).
    codes = [m["exit_code"] for m in final["attempts"][0]["members"]]
    assert codes == [VANISHED] * 3
    assert not bystander.got_sigterm()
    assert bystander.answers()


def test_a_forged_log_path_never_serves_the_token_file(
    serve: Callable[..., ServiceProc],
    etcd: Etcd,
) -> None:
    service = serve()
    token = service.generated_token()
    assert token, "serve made no token file to steal"
    token_file = service.data / "api-token"
    members = [
        {"index": 0, "pid": 4242, "started": 1.0, "rank": 0, "log": str(token_file)},
        {"index": 1, "pid": 4243, "started": 1.0, "rank": 1, "log": "../api-token"},
    ]
    write(etcd, "thief", running("thief", members, state="SUCCEEDED"))
    assert service.http.get("/v1/jobs/thief").status_code == 200
    for params in [{}, {"rank": 0}, {"rank": 1}]:
        response = service.http.get("/v1/jobs/thief/logs", params=params)
        assert response.status_code == 200
        assert token not in response.text and "submit" not in response.text


def test_a_forged_uid_never_makes_delete_remove_anything_outside_the_logs(
    serve: Callable[..., ServiceProc],
    etcd: Etcd,
) -> None:
    service = serve()
    logs = service.data / "logs"
    canary = service.data / "c"
    canary.mkdir()
    (canary / "keep").write_text("keep me")
    (logs / "evil-a-").mkdir(parents=True)  # `evil-a-/../../c` resolves to the canary
    (logs / "evil-b-0").mkdir()  # `evil-b-0/../../` resolves to the whole data folder
    forged = {"evil-a": "/../../c" + "0" * 24, "evil-b": "0/../../" + "0" * 24}
    for job_id, uid in forged.items():
        write(etcd, job_id, record(job_id, uid=uid, state="SUCCEEDED"))
    for job_id in forged:
        response = service.http.delete(f"/v1/jobs/{job_id}")
        assert response.status_code == 409, response.text
        detail = response.json()["detail"]
        assert f"the stored record of job '{job_id}' is invalid" in detail and "uid" in detail
        assert etcd.get(etcd.key("api", "jobs", job_id)) is not None  # not deleted either
    assert (canary / "keep").read_text() == "keep me"
    assert (logs / "evil-a-").is_dir() and (logs / "evil-b-0").is_dir()
    assert (service.data / "api-token").exists()


def test_invalid_records_are_named_skipped_and_left_alone_while_other_jobs_run(
    serve: Callable[..., ServiceProc],
    etcd: Etcd,
    bystanders: Callable[[], Bystander],
) -> None:
    bystander = bystanders()
    garbage = {"garbage": "{this is not json", "listish": "[1, 2, 3]"}
    for job_id, text in garbage.items():  # read by the mirror when the service starts
        write(etcd, job_id, text)
    service = serve()
    out_of_range = {  # each with a bystander's pid and a cancel: acted on, it would signal
        "index": [{"index": 5, "pid": bystander.pid, "started": bystander.started}],
        "rank": [{"index": 0, "pid": bystander.pid, "started": bystander.started, "rank": 3}],
    }
    forged: dict[str, dict[str, Any] | str] = {}
    for name, members in out_of_range.items():
        forged[f"range-{name}"] = running(f"range-{name}", members, cancel_requested_at=1.0)
    too_many = running("attempts", [{"index": 0, "pid": bystander.pid,
                                     "started": bystander.started}])  # fmt: skip
    too_many["attempts"] = [{**too_many["attempts"][0], "number": n} for n in (1, 2, 3)]
    too_many["cancel_requested_at"] = 1.0
    forged["attempts"] = too_many
    forged["strings"] = {**record("strings"), "submitted_at": "yesterday"}
    forged["elsewhere"] = record("somebody-else")  # under another job's key
    for job_id, value in forged.items():  # read through the mirror's watch
        write(etcd, job_id, value)
    invalid = {**garbage, **forged}
    revisions = {job_id: stored_revision(etcd, job_id) for job_id in invalid}

    causes = {
        "garbage": "signature: not JSON",
        "listish": "signature: the value is not a JSON object",
        "range-index": "index 5 is out of range for 1 workers",
        "range-rank": "rank 3 is out of range for 1 workers",
        "attempts": "3 attempts, but max_restarts 0 allows 1",
        "strings": "submitted_at",
        "elsewhere": "another job's key",
    }
    for job_id, cause in causes.items():
        response = service.http.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 409, response.text
        detail = response.json()["detail"]
        assert f"the stored record of job '{job_id}' is invalid" in detail and cause in detail
        for method, path in [("GET", "logs"), ("GET", "events"), ("POST", "cancel")]:
            other = service.http.request(method, f"/v1/jobs/{job_id}/{path}")
            assert other.status_code == 409 and cause in other.json()["detail"], other.text
        assert service.http.delete(f"/v1/jobs/{job_id}").status_code == 409

    listed = service.http.get("/v1/jobs")
    assert listed.status_code == 200 and listed.json()["jobs"] == []
    # The reconciler keeps serving other jobs: one submitted now runs to its end.
    spec = {"id": "after", "kind": "noop", "workers": 2, "params": {"seconds": 0}}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    assert wait_state(service, "after", {"SUCCEEDED"}, timeout=90)["state"] == "SUCCEEDED"
    assert [job["id"] for job in service.http.get("/v1/jobs").json()["jobs"]] == ["after"]
    # ... and never acted on the invalid ones, nor signalled anyone for them.
    assert {job_id: stored_revision(etcd, job_id) for job_id in invalid} == revisions
    assert not bystander.got_sigterm() and bystander.answers()
    # Each invalid version was logged once, however often it was read.
    log = service.data.with_suffix(".log").read_text(errors="replace")
    for job_id in invalid:
        key = etcd.key("api", "jobs", job_id)
        assert log.count(f"ignoring {key!r} (revision {revisions[job_id]})") == 1, job_id


def test_a_store_without_a_mirror_skips_invalid_records_in_its_pages(etcd: Etcd) -> None:
    store = JobStore(etcd, session_signer())
    for n in range(3):
        store.submit(JobSpec(id=f"ok-{n}", kind="noop", workers=1), time.time())
    write(etcd, "ok-1x", "{garbage")
    jobs, token = store.page(lambda _: True, 10, None)
    assert [job.id for job in jobs] == ["ok-0", "ok-1", "ok-2"] and token is None
    with pytest.raises(InvalidRecord, match="ok-1x"):
        store.get("ok-1x")
    with pytest.raises(InvalidRecord):
        store.update("ok-1x", lambda r: r.model_copy(update={"cancel_requested_at": 1.0}))
    assert etcd.get(etcd.key("api", "jobs", "ok-1x")).value == b"{garbage"  # type: ignore[union-attr]
