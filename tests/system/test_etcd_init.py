"""`python -m coordinator.deploy.etcd_init`: the one-shot setup of compose's init container
and Kubernetes' init Job, against a real etcd that starts with auth off."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.deploy.etcd_init import InitError, parse_agent, read_password
from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdRefused
from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.server import EmbeddedEtcd, ServerTls
from coordinator.etcd.users import agent_user, new_password, users, write_password_file
from tests.support.containers import INIT_SECRETS


@pytest.fixture
def plain_etcd() -> Iterator[EmbeddedEtcd]:
    """A fresh etcd as a deployment's starts: auth off, no users."""
    with EmbeddedEtcd(auth=False) as server:
        yield server


def run_init(
    endpoint: str, *args: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    # Not the tests' own etcd settings: only what the init container has.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORDINATOR_")}
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "coordinator.deploy.etcd_init", "--etcd", endpoint, *args],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def client(endpoint: str, user: str | None, password_file: Path | None, probe: str = "") -> Etcd:
    security = EtcdSecurity(user=user, password_file=str(password_file) if password_file else None)
    return Etcd(endpoint, security=security, connect_timeout=5, probe=probe)


def test_init_turns_auth_on_and_makes_each_agents_user_with_its_file_twice_over(
    plain_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    """Run twice (every `up`): auth on with root's password from its file; each agent's
    user has the password of its file and reaches only its own keys; no password is in
    the output; nobody without credentials gets in."""
    root = write_password_file(tmp_path / "root", new_password())
    agents = {a: write_password_file(tmp_path / a, new_password()) for a in ("agent-1", "agent-2")}
    args = ["--root-password-file", str(root), *(f"--agent={a}={f}" for a, f in agents.items())]
    for _ in range(2):
        result = run_init(plain_etcd.endpoint, *args)
        assert result.returncode == 0, result.stderr
        assert "auth on" in result.stdout
        for secret in (root, *agents.values()):
            assert secret.read_text().strip() not in result.stdout + result.stderr
    with pytest.raises(EtcdRefused, match="missing credentials"):
        client(plain_etcd.endpoint, None, None).close()
    with client(plain_etcd.endpoint, "root", root) as as_root:
        assert {agent_user("/coordinator", a) for a in agents} <= set(users(as_root))
    user = agent_user("/coordinator", "agent-1")
    with client(plain_etcd.endpoint, user, agents["agent-1"], "assignments/agent-1/") as agent:
        agent.put(agent.key("assignments", "agent-1", "m"), "mine")
        for forbidden in (("api", "jobs", "x"), ("assignments", "agent-2", "m")):
            with pytest.raises(EtcdRefused, match="permission denied"):
                agent.put(agent.key(*forbidden), "forged")
    # Another agent's password is not agent-1's.
    with pytest.raises(EtcdRefused, match="wrong credentials"):
        client(plain_etcd.endpoint, user, agents["agent-2"], "assignments/agent-1/").close()


def test_init_refuses_bad_files_and_arguments_naming_them(
    plain_etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    root = write_password_file(tmp_path / "root", new_password())
    short = write_password_file(tmp_path / "short", "abc")
    cases = [
        (["--root-password-file", str(tmp_path / "missing")], "cannot read"),
        (["--root-password-file", str(short)], "no password of 16+"),
        (["--root-password-file", str(root), "--agent", "agent-1"], "expected ID=PASSWORD_FILE"),
        (["--root-password-file", str(root), f"--agent=bad/id={root}"], "agent id"),
    ]
    for args, message in cases:
        result = run_init(plain_etcd.endpoint, *args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    # Once auth is on, a wrong root password is refused by etcd: exit 3, naming the cause.
    assert run_init(plain_etcd.endpoint, "--root-password-file", str(root)).returncode == 0
    other = write_password_file(tmp_path / "other", new_password())
    result = run_init(plain_etcd.endpoint, "--root-password-file", str(other))
    assert result.returncode == 3 and "wrong credentials" in result.stderr, result.stderr


def test_parsing_is_pure() -> None:
    assert parse_agent("agent-1=/run/secrets/a") == ("agent-1", Path("/run/secrets/a"))
    with pytest.raises(InitError, match="expected ID=PASSWORD_FILE"):
        parse_agent("agent-1=")
    with pytest.raises(InitError, match="cannot read"):
        read_password(Path("/nonexistent/password"), "--agent a")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_init_over_tls_with_client_certificates_from_the_one_time_step(tmp_path: Path) -> None:
    """compose.client-certs.yaml's etcd (TLS, --client-cert-auth) with init-secrets.sh's
    files: users are made as root, not as the client certificate's CN (which is no etcd
    user), though the first connection opened while auth was off."""
    secrets = tmp_path / "secrets"
    made = subprocess.run(
        [str(INIT_SECRETS), str(secrets)], capture_output=True, text=True, timeout=120
    )
    assert made.returncode == 0, made.stderr
    tls = ServerTls(secrets / "etcd.pem", secrets / "etcd-key.pem", secrets / "ca.pem")
    client_files = {
        "COORDINATOR_ETCD_CA": str(secrets / "ca.pem"),
        "COORDINATOR_ETCD_CERT": str(secrets / "client.pem"),
        "COORDINATOR_ETCD_KEY": str(secrets / "client-key.pem"),
    }
    with EmbeddedEtcd(auth=False, tls=tls) as server:
        args = [
            "--root-password-file", str(secrets / "etcd-root-password"),
            f"--agent=agent-1={secrets / 'agent-1-password'}",
        ]  # fmt: skip
        result = run_init(server.endpoint, *args, extra_env=client_files)
        assert result.returncode == 0, result.stderr
        security = EtcdSecurity(
            ca=client_files["COORDINATOR_ETCD_CA"],
            cert=client_files["COORDINATOR_ETCD_CERT"],
            key=client_files["COORDINATOR_ETCD_KEY"],
            user=agent_user("/coordinator", "agent-1"),
            password_file=str(secrets / "agent-1-password"),
        )
        probe = "assignments/agent-1/"
        with Etcd(server.endpoint, security=security, connect_timeout=5, probe=probe) as agent:
            agent.put(agent.key("assignments", "agent-1", "m"), "its own")
            refused = pytest.raises(EtcdRefused, match="permission denied")
            with refused:
                agent.put(agent.key("api", "jobs", "x"), "forged")
