"""etcd over TLS, with client certificates and a least-privilege user, for real.

Production etcd runs with TLS, `--client-cert-auth` and role-based auth, so the
product must work as a user that may touch only its own namespace, and a wrong
setting must stop a command at once (exit 3) with a message naming the setting,
not after a connect timeout with a gRPC riddle. One etcd serves the module: TLS
with certificates generated here (openssl), auth enabled with the `etcdctl`
commands docs/security.md gives.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdRefused
from coordinator.etcd.security import ENV, EtcdSecurity
from coordinator.etcd.server import EmbeddedEtcd, ServerTls, find_etcd_binary
from coordinator.etcd.session import Session
from tests.support.processes import Proc
from tests.support.service import ServiceProc, kill_members, wait_state
from tests.support.signing import key_files
from tests.support.wait import wait_until

NAMESPACE = "/tls-jobs"  # the trainer's role may read and write under NAMESPACE/ only


@dataclass(frozen=True)
class Pki:
    ca: Path
    other_ca: Path  # trusted by nobody here: the "wrong CA"
    server_cert: Path
    server_key: Path
    client_cert: Path  # CN is no etcd user: without a token, etcd refuses it
    client_key: Path
    stranger_cert: Path  # a client certificate signed by other_ca
    stranger_key: Path


def _openssl(*args: str | Path) -> None:
    result = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _key_and_request(folder: Path, name: str, cn: str) -> tuple[Path, Path]:
    key, request = folder / f"{name}.key", folder / f"{name}.csr"
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", request, "-subj", f"/CN={cn}",
    )  # fmt: skip
    return key, request


def _ca(folder: Path, name: str) -> Path:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", folder / f"{name}.key", "-out", folder / f"{name}.pem", "-days", "2",
        "-subj", f"/CN={name}",
    )  # fmt: skip
    return folder / f"{name}.pem"


def _signed(folder: Path, ca: Path, name: str, cn: str, extensions: str) -> tuple[Path, Path]:
    key, request = _key_and_request(folder, name, cn)
    (folder / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca.with_suffix(".key"),
        "-CAcreateserial", "-out", folder / f"{name}.pem", "-days", "2",
        "-extfile", folder / f"{name}.ext",
    )  # fmt: skip
    return folder / f"{name}.pem", key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        if os.environ.get("CI"):
            pytest.fail("the TLS tests need the openssl CLI to make their certificates")
        pytest.skip("no openssl CLI to make certificates with")
    folder = tmp_path_factory.mktemp("pki")
    ca, other_ca = _ca(folder, "ca"), _ca(folder, "other-ca")
    server_cert, server_key = _signed(
        folder, ca, "etcd", "etcd",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )  # fmt: skip
    client_cert, client_key = _signed(
        folder, ca, "client", "coordinator-client", "extendedKeyUsage=clientAuth\n"
    )
    stranger_cert, stranger_key = _signed(
        folder, other_ca, "stranger", "stranger", "extendedKeyUsage=clientAuth\n"
    )
    return Pki(
        ca, other_ca, server_cert, server_key, client_cert, client_key, stranger_cert, stranger_key
    )


@dataclass
class SecuredEtcd:
    server: EmbeddedEtcd
    pki: Pki
    passwords: Path  # <user>.password files, and wrong.password

    def security(self, user: str = "trainer", **change: str | None) -> EtcdSecurity:
        settings: dict[str, str | None] = {
            "ca": str(self.pki.ca),
            "cert": str(self.pki.client_cert),
            "key": str(self.pki.client_key),
            "user": user,
            "password_file": str(self.passwords / f"{user}.password"),
        }
        return EtcdSecurity(**{**settings, **change})

    def options(self, security: EtcdSecurity) -> list[str]:
        """The settings as command-line options."""
        return [
            arg
            for name in ENV
            if getattr(security, name)
            for arg in (f"--etcd-{name.replace('_', '-')}", getattr(security, name))
        ]


def _etcdctl(endpoint: str, pki: Pki, *args: str) -> str:
    etcd = find_etcd_binary()
    binary = shutil.which("etcdctl") if etcd == shutil.which("etcd") else None
    binary = binary or str(Path(etcd).with_name("etcdctl"))
    tls = ["--cacert", str(pki.ca), "--cert", str(pki.client_cert), "--key", str(pki.client_key)]
    result = subprocess.run(
        [binary, "--endpoints", endpoint, *tls, *args], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, f"etcdctl {' '.join(args)}: {result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def secured(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredEtcd]:
    """etcd with TLS and client-certificate auth, and role-based auth enabled: `trainer`
    may read and write NAMESPACE/, `outsider` only another prefix."""
    passwords = tmp_path_factory.mktemp("passwords")
    for user in ("root", "trainer", "outsider", "wrong"):
        path = passwords / f"{user}.password"
        path.write_text(f"{user}-secret-{os.getpid()}\n")
        path.chmod(0o600)
    # Auth set up by hand below, as docs/security.md tells an operator to.
    server = EmbeddedEtcd(tls=ServerTls(pki.server_cert, pki.server_key, pki.ca), auth=False)
    try:
        server.start()

        def ctl(*args: str) -> str:
            return _etcdctl(server.endpoint, pki, *args)

        def add_user(user: str) -> None:
            secret = (passwords / f"{user}.password").read_text().strip()
            ctl("user", "add", user, "--interactive=false", f"--new-user-password={secret}")

        # docs/security.md, with the root user the test needs to enable auth.
        add_user("root")
        for user, role, prefix in [
            ("trainer", "coordinator", NAMESPACE + "/"),
            ("outsider", "elsewhere", "/elsewhere/"),
        ]:
            ctl("role", "add", role)
            ctl("role", "grant-permission", role, "--prefix=true", "readwrite", prefix)
            add_user(user)
            ctl("user", "grant-role", user, role)
        ctl("auth", "enable")
        yield SecuredEtcd(server, pki, passwords)
    finally:
        server.close()


@pytest.fixture(autouse=True)
def no_inherited_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the settings a test gives: not the session etcd's root (tests/conftest.py)."""
    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)


def _coordinator(*args: str) -> list[str]:
    return [sys.executable, "-m", "coordinator", *args]


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes started by a test; every one still running at its end is killed."""
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.kill()


def _start(procs: list[Proc], args: list[str]) -> Proc:
    """A process with the test's environment (monkeypatch it to add variables)."""
    proc = Proc(args)
    procs.append(proc)
    return proc


def test_a_restricted_user_runs_a_3_member_xgboost_job_over_tls(
    secured: SecuredEtcd, procs: list[Proc], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    security = secured.security()
    args = _coordinator(
        "run", "xgboost", "--workers", "3", "--param", "rounds=5", "--job", "tls-boost",
        "--etcd", secured.server.endpoint, "--namespace", NAMESPACE, "--timeout", "60",
        *secured.options(security),
    )  # fmt: skip
    monkeypatch.setenv("COORDINATOR_ARTIFACTS", str(tmp_path))
    run = _start(procs, args)
    code = run.wait_exit(120)
    output = "\n".join(run.stderr)
    assert code == 0, output
    assert "all 3 workers passed every phase and cleaned up" in output
    assert (tmp_path / "tls-boost").is_dir()
    # The workers got the settings from the environment `run` passed on, as a service's
    # or an agent's members do; the password only as a file's path.
    assert "secret" not in " ".join(args)
    with Etcd(secured.server.endpoint, namespace=NAMESPACE, security=security) as etcd:
        assert etcd.count_prefix(etcd.key("jobs", "tls-boost", "rendezvous") + "/") == 0
        assert etcd.get_prefix(etcd.key("jobs", "tls-boost") + "/")[0]  # what a job keeps


def test_a_member_takes_its_settings_from_the_environment(
    secured: SecuredEtcd, procs: list[Proc], monkeypatch: pytest.MonkeyPatch
) -> None:
    security = secured.security()
    for name, var in ENV.items():
        monkeypatch.setenv(var, getattr(security, name))
    args = _coordinator(
        "worker", "--job", "tls-env", "--world-size", "1", "--etcd", secured.server.endpoint,
        "--namespace", NAMESPACE,
    )  # fmt: skip
    worker = _start(procs, args)
    assert worker.wait_exit(60) == 0, worker.stderr
    assert worker.events[-1]["event"] == "done"


@pytest.mark.parametrize(
    ("wrong", "named"),
    [
        (lambda s: s.security(cert=None, key=None), "missing client certificate"),
        (lambda s: s.security(ca=str(s.pki.other_ca)), "untrusted server"),
        (
            lambda s: s.security(password_file=str(s.passwords / "wrong.password")),
            "wrong credentials",
        ),
        (lambda s: s.security("outsider"), "permission denied"),
    ],
    ids=["no-client-certificate", "wrong-ca", "wrong-password", "no-rights-on-the-prefix"],
)
def test_a_wrong_setting_exits_3_naming_it(
    secured: SecuredEtcd,
    procs: list[Proc],
    wrong: Callable[[SecuredEtcd], EtcdSecurity],
    named: str,
) -> None:
    security = wrong(secured)
    args = _coordinator(
        "worker", "--job", "tls-refused", "--world-size", "1", "--etcd", secured.server.endpoint,
        "--namespace", NAMESPACE, "--connect-timeout", "20", *secured.options(security),
    )  # fmt: skip
    worker = _start(procs, args)
    assert worker.wait_exit(60) == 3, worker.stderr
    failed = worker.wait_event(lambda e: e["event"] == "failed")
    assert failed["exit_code"] == 3 and failed["phase"] == "etcd_connect"
    assert failed["message"].startswith(named), failed["message"]
    assert any(named in line for line in worker.stderr), worker.stderr
    # Refused at once: TLS and auth failures are not retried for the connect timeout.
    assert "within 20s" not in failed["message"]


def test_settings_are_checked_before_anything_connects(
    secured: SecuredEtcd, procs: list[Proc]
) -> None:
    endpoint, pki = secured.server.endpoint, secured.pki
    for extra, named in [
        (["--etcd", endpoint, "--etcd-cert", str(pki.client_cert)], "--etcd-key"),
        (["--etcd", "127.0.0.1:1", "--etcd-ca", str(pki.ca)], "https://"),
        (["--etcd", endpoint, "--etcd-user", "trainer"], "--etcd-password-file"),
    ]:
        proc = _start(procs, _coordinator("worker", "--job", "j", "--world-size", "1", *extra))
        assert proc.wait_exit(30) == 2, proc.stderr
        assert named in "\n".join(proc.stderr)


def test_the_service_an_agent_and_their_members_work_as_the_restricted_user(
    secured: SecuredEtcd, procs: list[Proc], tmp_path: Path
) -> None:
    """Members started by the service's local launcher and by an agent inherit the
    settings through the environment, and the agent hands on `https://` endpoints."""
    data = tmp_path / "service"
    data.mkdir()
    options = secured.options(secured.security())
    agent_args = _coordinator(
        "agent", "--etcd", secured.server.endpoint, "--namespace", NAMESPACE, "--id", "tls-agent",
        "--data-dir", str(tmp_path / "agent"), "--ttl", "2", *options,
        "--service-key", str(key_files()[1]),
    )  # fmt: skip
    _start(procs, agent_args)
    service = ServiceProc(secured.server.endpoint, NAMESPACE, data, *options)
    try:
        service.ready()
        for launcher in ("local", "agents"):
            spec = {"id": f"tls-{launcher}", "kind": "noop", "workers": 2, "launcher": launcher}
            response = service.http.post("/v1/jobs", json=spec)
            assert response.status_code == 201, response.text
        for launcher in ("local", "agents"):
            record = wait_state(service, f"tls-{launcher}", {"SUCCEEDED", "FAILED"}, timeout=60)
            assert record["state"] == "SUCCEEDED", record
        # `trainer` may not make users: the members connected as the service's user, and
        # the service said so once, naming what to grant.
        warnings = service.output().count("may not manage etcd users and roles")
        assert warnings == 1, service.output()
        assert "grant-role trainer root" in service.output()
    finally:
        service.stop()
        kill_members(data)


def test_the_etcd_layer_names_the_cause_of_a_refusal(secured: SecuredEtcd) -> None:
    pki = secured.pki
    stranger = secured.security(cert=str(pki.stranger_cert), key=str(pki.stranger_key))
    for security, cause in [
        (secured.security("outsider"), "permission-denied"),
        (stranger, "client-certificate"),
        (secured.security(ca=str(pki.other_ca)), "untrusted-server"),
    ]:
        with pytest.raises(EtcdRefused) as refused:
            Etcd(secured.server.endpoint, namespace=NAMESPACE, security=security)
        assert refused.value.cause == cause, refused.value
    assert str(refused.value).startswith("untrusted server")


def test_the_client_authenticates_again_after_etcd_restarts(secured: SecuredEtcd) -> None:
    """etcd forgets its tokens when it restarts: unary calls, the watch stream and the
    lease keepalive must all carry a fresh one afterwards. (Last: it restarts etcd.)"""
    seen: list[str] = []
    with Etcd(secured.server.endpoint, namespace=NAMESPACE, security=secured.security()) as etcd:
        key = etcd.key("restart", "watched")
        watch = etcd.watch(key, lambda events: seen.extend(e.key for e in events), 1)
        session = Session(etcd, ttl=4)
        try:
            secured.server.stop()
            secured.server.start()
            etcd.put(key, "after the restart", lease=session.lease_id)
            wait_until(lambda: key in seen, 15, "the watch to see the write after the restart")
            assert etcd._auth is not None and etcd._auth.authentications >= 2
            assert not session.lost.is_set(), session.lost_reason
        finally:
            session.close()
            watch.cancel()
