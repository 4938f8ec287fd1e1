"""A deployment's etcd, made ready once: auth on, one etcd user per agent, and one per
job run without the service (compose/ddp.yaml's members: `--job ID=PASSWORD_FILE`).

compose's `etcd-init` container and Kubernetes' `coordinator-etcd-init` Job run it
before the service and the agents start:

    python -m coordinator.deploy.etcd_init --etcd https://etcd:2379 \\
        --root-password-file /run/secrets/etcd-root-password \\
        --agent agent-1=/run/secrets/agent-1-password ...

Every password comes from a file the one-time step wrote (`compose/init-secrets.sh`, or
the Kubernetes Secrets): none is made here, none is in argv or the environment, and
the containers that need one mount only their own. Safe to repeat on every `up`: auth
already on is left as it is (the root password must then be the one etcd has), and each
agent's user gets its role and the password in its file again.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from pyetcd import etcdrpc

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.names import check_name
from coordinator.etcd.security import EtcdSecurity, SecurityError
from coordinator.etcd.users import ROOT, enable_auth, provision_agent, provision_job
from coordinator.exit_codes import EXIT_ETCD_UNAVAILABLE

#: A password shorter than this is no password a generator made.
MIN_PASSWORD = 16


class InitError(ValueError):
    """A bad argument or file; the message names it."""


def parse_agent(value: str, option: str = "--agent") -> tuple[str, Path]:
    """`ID=PASSWORD_FILE` as (agent or job id, path)."""
    agent_id, sep, path = value.partition("=")
    if not sep or not path:
        raise InitError(f"{option} {value!r}: expected ID=PASSWORD_FILE")
    try:
        check_name("agent id" if option == "--agent" else "job id", agent_id)
    except ValueError as exc:
        raise InitError(f"{option} {value!r}: {exc}") from None
    return agent_id, Path(path)


def read_password(path: Path, what: str) -> str:
    """The password in `path` (its first line), refused if unreadable or too short."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise InitError(f"{what}: cannot read {path}: {exc.strerror}") from None
    password = text.splitlines()[0].strip() if text.strip() else ""
    if len(password) < MIN_PASSWORD:
        raise InitError(f"{what}: {path} holds no password of {MIN_PASSWORD}+ characters")
    return password


def set_password(etcd: Etcd, user: str, password: str) -> None:
    request = etcdrpc.AuthUserChangePasswordRequest(name=user, password=password)
    etcd.auth_api("UserChangePassword", request)


def initialise(
    connect: Callable[[], Etcd],
    root_password: str,
    agents: dict[str, str],
    jobs: dict[str, str] | None = None,
) -> list[str]:
    """Auth on with `root_password`; each agent's user (`provision_agent`) and each job's
    (`provision_job`: its own keys only) with the password given for it. Returns the
    etcd user names made.

    The users are made through a second connection: one opened while auth was off holds
    no token, and etcd would take it for the user its client certificate names (with
    `--client-cert-auth`) instead of root."""
    with connect() as etcd:
        enable_auth(etcd, root_password)
    made = []
    with connect() as etcd:
        for agent_id, password in agents.items():
            credentials = provision_agent(etcd, agent_id)  # its role, and a password of its own
            set_password(etcd, credentials.user, password)  # ... replaced by its file's
            made.append(credentials.user)
        for job_id, password in (jobs or {}).items():
            made.append(provision_job(etcd, job_id, password).user)
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinator.deploy.etcd_init")
    parser.add_argument("--etcd", default=os.environ.get("COORDINATOR_ETCD"), help="endpoints")
    parser.add_argument(
        "--namespace", default=os.environ.get("COORDINATOR_NAMESPACE", "/coordinator")
    )
    parser.add_argument("--root-password-file", type=Path, required=True)
    parser.add_argument("--agent", action="append", default=[], help="ID=PASSWORD_FILE")
    parser.add_argument("--job", action="append", default=[], help="JOB_ID=PASSWORD_FILE")
    parser.add_argument("--connect-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    try:
        if not args.etcd:
            raise InitError("--etcd (or COORDINATOR_ETCD) is required")
        root_password = read_password(args.root_password_file, "--root-password-file")
        agents: dict[str, str] = {}
        for value in args.agent:
            agent_id, path = parse_agent(value)
            agents[agent_id] = read_password(path, f"--agent {agent_id}")
        jobs: dict[str, str] = {}
        for value in args.job:
            job_id, path = parse_agent(value, "--job")
            jobs[job_id] = read_password(path, f"--job {job_id}")
        # TLS files (the CA) from COORDINATOR_ETCD_CA and the like; the user is root.
        tls = EtcdSecurity.from_env()
        security = EtcdSecurity(
            ca=tls.ca,
            cert=tls.cert,
            key=tls.key,
            user=ROOT,
            password_file=str(args.root_password_file),
        ).check()
    except (InitError, SecurityError) as exc:
        print(f"etcd init: {exc}", file=sys.stderr)
        return 2

    def connect() -> Etcd:
        return Etcd(
            args.etcd,
            namespace=args.namespace,
            security=security,
            connect_timeout=args.connect_timeout,
        )

    try:
        users = initialise(connect, root_password, agents, jobs)
    except EtcdError as exc:
        print(f"etcd init: {exc}", file=sys.stderr)
        return EXIT_ETCD_UNAVAILABLE
    print(f"etcd init: auth on; users: {', '.join(users) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
