"""The `command` kind through the REST service: a real `coordinator serve`, real members
running real programs, locally and on a real `coordinator agent`.

The program is `python -c ...` (the service's interpreter), so each test says in one
line what every member's program does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.etcd.client import Etcd
from tests.support.agents import registered
from tests.support.processes import gone
from tests.support.service import ServiceProc, wait_state
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd
READ = "reader-token-0123456789"
SUBMIT = "submitter-token-0123456789"
EXEC = "executor-token-0123456789"


def program(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def as_(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_command_job_runs_its_program_on_three_members_with_its_env_and_folder(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()  # its generated token has the exec role
    folder = service.data / "work" / "here"
    folder.mkdir()
    show = "import os; print('ran', os.environ['RANK'], os.environ['WORLD_SIZE'], "
    show += "os.environ['GREETING'], os.getcwd(), 'COORDINATOR_PROGRAM_ENV' in os.environ)"
    spec = {"id": "prog", "kind": "command", "workers": 3, "command": program(show),
            "env": {"GREETING": "hello-there"}, "working_dir": "here"}  # fmt: skip
    response = service.http.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["working_dir"] == str(folder.resolve())  # stored absolute

    record = wait_state(service, "prog", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "SUCCEEDED", record["conditions"]
    logs = service.http.get("/v1/jobs/prog/logs").text
    for rank in range(3):
        assert f"[rank {rank}] ran {rank} 3 hello-there {folder.resolve()} False" in logs, logs
    # The programs' lines alone; the members' own events on request.
    assert '"event"' not in logs, logs
    tail = service.http.get("/v1/jobs/prog/logs", params={"rank": 2, "tail": 1}).text
    assert tail.startswith("[rank 2] ran 2 3"), tail
    everything = service.http.get("/v1/jobs/prog/logs", params={"events": True}).text
    assert '"event": "done"' in everything and "hello-there" in everything


def test_relative_program_paths_start_in_the_working_dir_root_and_a_missing_folder_is_422(
    serve: Callable[..., ServiceProc],
) -> None:
    """The rule: a program runs in its working_dir, under `serve --working-dir-root`
    (default DATA_DIR/work), and without one in that root itself; so `python train.py`
    finds train.py there. A folder that is not there is refused at submit, saying how."""
    service = serve()
    root = service.data / "work"
    (root / "train.py").write_text("import os; print('trained in', os.getcwd())\n")
    (root / "proj").mkdir()
    (root / "proj" / "train.py").write_text("import os; print('project in', os.getcwd())\n")
    jobs = {"at-root": {}, "in-proj": {"working_dir": "proj"}}
    for job_id, extra in jobs.items():
        spec = {"id": job_id, "kind": "command", "workers": 1,
                "command": [sys.executable, "train.py"], **extra}  # fmt: skip
        assert service.http.post("/v1/jobs", json=spec).status_code == 201
    shown_by = {"at-root": f"trained in {root}", "in-proj": f"project in {root}/proj"}
    for job_id, shown in shown_by.items():
        record = wait_state(service, job_id, {"SUCCEEDED", "FAILED"})
        assert record["state"] == "SUCCEEDED", record["conditions"]
        assert shown in service.http.get(f"/v1/jobs/{job_id}/logs").text
    missing = {"kind": "command", "workers": 1, "command": ["python", "x.py"]}
    missing["working_dir"] = "nope"
    answer = service.http.post("/v1/jobs", json=missing)
    assert answer.status_code == 422
    [detail] = answer.json()["detail"]
    assert detail["loc"][-1] == "working_dir"
    assert f"mkdir -p {root}/nope" in detail["msg"], detail
    outside = service.http.post("/v1/jobs", json={**missing, "working_dir": "/etc"})
    assert "--working-dir-root" in outside.json()["detail"][0]["msg"]


def test_a_newcomer_makes_an_exec_token_and_submits_a_program_with_it(
    serve: Callable[..., ServiceProc], tmp_path: Path
) -> None:
    """The README's way: `coordinator credentials token exec` writes an exec token where
    the CLI looks, `serve --token-file` takes it, `submit -- PROGRAM` finds it."""
    data = tmp_path / "coordinator-data"
    env = {k: v for k, v in os.environ.items() if k != "COORDINATOR_TOKEN"}
    env["COORDINATOR_DATA"] = str(data)
    made = subprocess.run(
        [sys.executable, "-m", "coordinator", "credentials", "token", "exec"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert f"exec {token}" in (data / "api-token").read_text()
    assert (data / "api-token").stat().st_mode & 0o777 == 0o600
    service = serve("--token-file", str(data / "api-token"), data=data, exec_token=False)
    submitted = subprocess.run(
        [sys.executable, "-m", "coordinator", "submit", "--server", service.url, "--id",
         "first", "--workers", "1", "--wait", "--", sys.executable, "-c", "print('hello')"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    as_exec = {"Authorization": f"Bearer {token}"}
    assert service.http.get("/v1/whoami", headers=as_exec).json()["role"] == "exec"


def test_a_crash_on_rank_1_is_named_first_with_its_error_line_and_its_logs_command(
    serve: Callable[..., ServiceProc],
) -> None:
    """Rank 1 raises; the others' programs fail a moment later (as a collective's peers
    would). The reason starts with rank 1, holds its error, and says how to see its
    output, in the record and in `coordinator status`."""
    service = serve()
    code = (
        "import os, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "if rank == 1:\n"
        "    raise RuntimeError(f'boom on rank {rank} at step 5')\n"
        "time.sleep(1)\n"
        "sys.exit('gloo: connection closed by peer')\n"
    )
    spec = {"id": "crash", "kind": "command", "workers": 3, "command": program(code)}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    record = wait_state(service, "crash", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "FAILED"
    reason = record["conditions"][-1]["reason"]
    assert reason.startswith(
        "rank 1: the program exited with code 1 (RuntimeError: boom on rank 1 at step 5)"
    ), reason
    assert reason.endswith("; its output: coordinator logs crash --rank 1"), reason
    assert "gloo: connection closed by peer" in reason  # the others', after it
    env = {**os.environ, "COORDINATOR_DATA": str(service.data), "COLUMNS": "400"}
    env.pop("COORDINATOR_TOKEN", None)
    status = subprocess.run(
        [sys.executable, "-m", "coordinator", "status", "crash", "--server", service.url],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert status.returncode == 1
    assert "rank 1: the program exited with code 1 (RuntimeError: boom on rank 1" in status.stdout
    assert "coordinator logs crash --rank 1" in status.stdout


def test_only_exec_tokens_run_programs_and_bad_command_specs_are_named(
    serve: Callable[..., ServiceProc],
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"read {READ}\nsubmit {SUBMIT}\nexec {EXEC}\n")
    tokens.chmod(0o600)
    service = serve("--token-file", str(tokens), "--working-dir-root", str(tmp_path / "work"))
    spec: dict[str, Any] = {"kind": "command", "workers": 1, "command": program("pass")}
    post = service.http.post

    assert post("/v1/jobs", json=spec, headers=as_(READ)).status_code == 403
    refused = post("/v1/jobs", json=spec, headers=as_(SUBMIT))
    assert refused.status_code == 403 and "exec" in refused.json()["detail"]
    noop = {"kind": "noop", "workers": 1}
    assert post("/v1/jobs", json=noop, headers=as_(SUBMIT)).status_code == 201  # as before
    assert post("/v1/jobs", json=noop, headers=as_(EXEC)).status_code == 201  # exec > submit
    made = post("/v1/jobs", json=spec, headers=as_(EXEC))
    assert made.status_code == 201, made.text

    def field_of(body: dict[str, Any]) -> tuple[list[Any], str]:
        answer = post("/v1/jobs", json=body, headers=as_(EXEC))
        assert answer.status_code == 422, answer.text
        detail = answer.json()["detail"][0]
        return detail["loc"], detail["msg"]

    loc, msg = field_of({**spec, "working_dir": str(tmp_path)})  # the root's parent
    assert loc[-1] == "working_dir" and "outside" in msg
    loc, msg = field_of({**spec, "working_dir": "../up"})
    assert loc[-1] == "working_dir"
    loc, msg = field_of({**spec, "env": {"RANK": "3", "OK": "1"}})
    assert "env" in loc and "RANK" in msg and "OK" not in msg
    loc, msg = field_of({**spec, "env": {"COORDINATOR_ETCD": "elsewhere:2379"}})
    assert "env" in loc and "COORDINATOR_ETCD" in msg
    loc, _ = field_of({**spec, "env": {"NOT-A-NAME": "x"}})
    assert "env" in loc
    loc, _ = field_of({**spec, "command": []})
    assert "command" in loc
    loc, _ = field_of({"kind": "command", "workers": 1})
    assert loc[-1] == "command"
    loc, msg = field_of({**noop, "command": ["true"]})
    assert loc[-1] == "command" and "noop" in msg
    loc, _ = field_of({**noop, "env": {"A": "b"}})
    assert loc[-1] == "env"
    loc, _ = field_of({**spec, "launcher": "docker"})  # not enabled here
    assert loc[-1] == "launcher"
    loc, msg = field_of({**spec, "image": "python:3.12"})  # only containers have images
    assert loc[-1] == "image" and "docker" in msg
    loc, _ = field_of({**spec, "image": "Not An Image"})
    assert loc[-1] == "image"
    loc, _ = field_of({**noop, "image": "python:3.12"})
    assert loc[-1] == "image"


def test_a_command_job_runs_on_an_agent(
    serve: Callable[..., ServiceProc],
    agents: Any,
    etcd: Etcd,
) -> None:
    agent = agents("--id", "runner", "--slots", "2")
    wait_until(lambda: registered(etcd, "runner"), 30, "the agent to register")
    service = serve("--default-launcher", "agents")
    show = "import os; print('agent ran', os.environ['RANK'], os.environ['SECRET_NAME'])"
    spec = {"id": "onagent", "kind": "command", "workers": 2, "command": program(show),
            "env": {"SECRET_NAME": "s3cr3t-value"}}  # fmt: skip
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    record = wait_state(service, "onagent", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "SUCCEEDED", record["conditions"]
    logs = service.http.get("/v1/jobs/onagent/logs").text
    assert "[rank 0] agent ran 0 s3cr3t-value" in logs and "agent ran 1" in logs, logs
    assert agent.process.poll() is None


def test_an_agent_accepts_exactly_a_command_assignment_shape(tmp_path: Path) -> None:
    """Pure: what `Assignment` lets through to an agent's members."""
    from pydantic import ValidationError

    from coordinator.service.placement.protocol import Assignment

    args = ["--job", "j", "--world-size", "1", "--kind", "command"]
    base = {"run_id": "j-1234abcd", "attempt": 1, "index": 0, "worker_args": args}
    context = {"data_dir": tmp_path, "working_dir_roots": [str(tmp_path)]}

    def check(**extra: Any) -> Assignment:
        return Assignment.model_validate({**base, **extra}, context=context)

    assert check(command=["python", "x.py"], working_dir=str(tmp_path / "w")).command
    bad: list[dict[str, Any]] = [
        {},  # --kind command needs its program
        {"command": ["python"], "worker_args": args[:4]},  # a program for another kind
        {"command": ["python"], "working_dir": "/etc"},  # outside the agent's roots
        {"command": ["python"], "working_dir": str(tmp_path / ".." / "x")},
        {"command": ["python"], "env": {"MASTER_ADDR": "elsewhere"}},
        {"command": ["python"], "worker_args": [*args, "--", "python"]},  # no `--` in args
    ]
    for extra in bad:
        with pytest.raises(ValidationError):
            check(**extra)


def test_a_killed_member_restarts_the_job_and_its_programs_are_all_gone(
    serve: Callable[..., ServiceProc],
) -> None:
    """A member SIGKILLed while every program runs: the other member's program is stopped,
    the attempt fails naming the lost rank, and with `max_restarts=1` a second attempt
    runs the program again (it finds its marker and ends at once) and succeeds. No
    program of the first attempt is left."""
    service = serve()
    folder = service.data / "work" / "restart"
    folder.mkdir()
    code = (
        "import os, sys, time\n"
        "marker = 'started-' + os.environ['RANK']\n"
        "if os.path.exists(marker): sys.exit(0)\n"
        "open(marker, 'w').write(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    spec = {"id": "again", "kind": "command", "workers": 2, "command": program(code),
            "working_dir": "restart", "max_restarts": 1}  # fmt: skip
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    markers = [folder / f"started-{rank}" for rank in range(2)]
    wait_until(lambda: all(m.exists() and m.read_text() for m in markers), 60, "both programs")
    programs = [int(m.read_text()) for m in markers]
    record = service.http.get("/v1/jobs/again").json()
    member = next(m for m in record["attempts"][0]["members"] if m["rank"] == 1)
    os.kill(member["pid"], signal.SIGKILL)

    record = wait_state(service, "again", {"SUCCEEDED", "FAILED"}, timeout=90)
    assert record["state"] == "SUCCEEDED", record["conditions"]
    assert len(record["attempts"]) == 2 and "rank 1" in record["attempts"][0]["outcome"]
    # Reaped with their members (the killed one's by its reaper, a moment after it died).
    wait_until(lambda: gone(programs), 10, "the first attempt's programs to end")


def test_coordinator_submit_takes_a_program_after_dashes_and_env_from_the_shell(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()
    show = "import os; print('greeting', os.environ['RANK'], os.environ['GREETING'])"
    cli = [sys.executable, "-m", "coordinator", "submit", "--server", service.url,
           "--token", service.generated_token() or "", "--workers", "2", "--id", "by-cli",
           "--env", "GREETING", "--wait", "--", *program(show)]  # fmt: skip
    environment = {**os.environ, "GREETING": "from-the-shell"}
    done = subprocess.run(cli, env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "from-the-shell" not in " ".join(cli)  # the value came from the environment
    logs = service.http.get("/v1/jobs/by-cli/logs").text
    assert "[rank 0] greeting 0 from-the-shell" in logs and "[rank 1] greeting 1" in logs
    missing = subprocess.run(
        [*cli[:-4], "--env", "NOT_SET_ANYWHERE_4711", "--", "true"],
        env=environment, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    said = " ".join(missing.stderr.replace("│", " ").split())  # typer's error box, unwrapped
    assert missing.returncode == 2 and "'NOT_SET_ANYWHERE_4711' is not set in this" in said


def test_the_docker_launcher_admits_command_jobs_only_in_allowed_images(
    serve: Callable[..., ServiceProc],
    tmp_path: Path,
) -> None:
    """Admission only (the engine is never reached here): the service's own image and the
    `--allowed-image` globs are admitted, anything else is a 422 naming `image`; the folder
    is the container's (absolute, no `..`), never looked for on this host."""
    service = serve(
        "--docker-image", "localhost/coordinator/worker:1",
        "--docker-etcd", "etcd.invalid:2379", "--docker-host", f"unix://{tmp_path}/no.sock",
        "--allowed-image", "localhost/trainers/*", "--allowed-image", "ddp:*",
    )  # fmt: skip
    spec: dict[str, Any] = {
        "kind": "command", "workers": 1, "launcher": "docker", "command": ["python", "x.py"],
    }  # fmt: skip

    def refused(body: dict[str, Any]) -> tuple[Any, str]:
        answer = service.http.post("/v1/jobs", json=body)
        assert answer.status_code == 422, answer.text
        return answer.json()["detail"][0]["loc"][-1], answer.json()["detail"][0]["msg"]

    for image in ("localhost/trainers/mnist:2", "ddp:latest"):
        made = service.http.post("/v1/jobs", json={**spec, "image": image, "working_dir": "/srv"})
        assert made.status_code == 201, made.text
        assert made.json()["spec"]["image"] == image
        assert made.json()["spec"]["working_dir"] == "/srv"  # not on this host: not checked
    for image in ("python:3.12", "localhost/trainers/a/b:1", "ddp-evil:1", "localhost/ddp:1"):
        field, message = refused({**spec, "image": image})
        assert field == "image" and image in message and "ddp:*" in message
    # Without an image: the service's own, which --allowed-image no longer includes.
    field, message = refused(spec)
    assert field == "image" and "localhost/coordinator/worker:1" in message
    for folder in ("relative/dir", "/srv/../etc"):
        field, _ = refused({**spec, "image": "ddp:1", "working_dir": folder})
        assert field == "working_dir"
    field, _ = refused({**spec, "image": "ddp:1", "launcher": "kubernetes"})
    assert field == "launcher"


def test_serve_refuses_an_allowed_image_that_is_no_image_name(tmp_path: Path) -> None:
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "serve", "--data-dir", str(tmp_path),
         "--docker-image", "localhost/w:1", "--docker-etcd", "etcd:2379",
         "--allowed-image", "Not/Valid Image"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert "--allowed-image" in result.stderr and "Not/Valid Image" in result.stderr


def test_the_docker_launcher_starts_nothing_in_an_image_it_does_not_allow(tmp_path: Path) -> None:
    """A record read from etcd is not trusted: a `command` job whose image the launcher
    does not allow (a forged record, or a service restarted with another list) fails to
    start, naming the image, before the engine is asked anything (there is none here)."""
    from coordinator.launch import WorkerCommand
    from coordinator.service.images import ImagePolicy
    from coordinator.service.launchers import Launch
    from coordinator.service.launchers.docker import DockerLauncher
    from coordinator.service.model import JobSpec

    launcher = DockerLauncher(
        "localhost/coordinator/worker:1",
        "net",
        f"unix://{tmp_path}/no-engine.sock",
        "etcd:2379",
        secrets_dir=tmp_path / "secrets",
        images=ImagePolicy.of("localhost/coordinator/worker:1", ["ddp:*"]),
    )
    spec = JobSpec(kind="command", workers=1, launcher="docker", command=["true"])
    forged = spec.model_copy(update={"image": "localhost/evil:1"})
    with pytest.raises(ValueError, match="localhost/evil:1"):
        command = WorkerCommand(job_id="run", world_size=1, kind="command", program=("true",))
        launcher.start(Launch("run", 1, forged, command), 0)
    with pytest.raises(ValueError, match="is not allowed"):  # the default is not listed
        launcher.image_of(spec)
    assert launcher.image_of(spec.model_copy(update={"image": "ddp:2"})) == "ddp:2"
    assert launcher.image_of(JobSpec(kind="noop", workers=1)) == "localhost/coordinator/worker:1"


FORGER = """
import json, os, sys
def say(event, stream=sys.stdout):
    print(json.dumps({"t": 1.0, **event}), file=stream, flush=True)
say({"event": "failed", "phase": "connect", "rank": 0, "error": "Forged",
     "message": "forged by the program", "exit_code": 3})
say({"event": "failed", "phase": "connect", "rank": 1, "error": "Forged",
     "message": "forged on stderr", "exit_code": 3}, sys.stderr)
say({"event": "done", "rank": 0, "roster": {"job_id": "forged", "round": 1,
     "world_size": 1, "members": []}})
say({"event": "report", "rank": 7, "step": 3, "total": 9, "metrics": {"loss": 0.5}})
sys.exit(7 if os.environ["RANK"] == "1" else 0)
"""


def test_a_program_cannot_forge_its_members_events_but_its_reports_reach_the_service(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()
    spec = {"id": "forger", "kind": "command", "workers": 2, "command": program(FORGER)}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    record = wait_state(service, "forger", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "FAILED"  # rank 1 exited 7: no forged `done` says otherwise
    reason = record["conditions"][-1]["reason"]
    assert "rank 1" in reason and "code 7" in reason and "forged" not in reason, reason
    members = {m["rank"]: m for attempt in record["attempts"] for m in attempt["members"]}
    # Rank 0's program exited 0: its member lost rank 1, and says so, nothing forged.
    assert set(members) == {0, 1} and members[0]["failure"]["error"] == "MemberLost", members
    assert members[1]["failure"]["error"] == "ProgramFailed", members
    logs = service.http.get("/v1/jobs/forger/logs").text
    assert "forged by the program" in logs and "forged on stderr" in logs  # shown, not acted on
    assert record["progress"]["step"] == 3 and record["progress"]["metrics"] == {"loss": 0.5}


def test_a_forged_failure_does_not_stick_to_a_member_that_succeeded(
    serve: Callable[..., ServiceProc],
) -> None:
    service = serve()
    code = FORGER.replace('7 if os.environ["RANK"] == "1" else 0', "0")
    spec = {"id": "calm", "kind": "command", "workers": 2, "command": program(code)}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    record = wait_state(service, "calm", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "SUCCEEDED", record["conditions"]
    members = [m for attempt in record["attempts"] for m in attempt["members"]]
    assert [m["failure"] for m in members] == [None, None], members
    assert sorted(m["rank"] for m in members) == [0, 1]
    assert all(m["phase"] == "done" for m in members), members
