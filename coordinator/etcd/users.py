"""etcd users of least privilege: one per job, one per agent, and root to make them.

Whoever holds a user's password can do what its role allows and nothing else, so
a member's credentials reach only its own job's keys (`<ns>/jobs/<id>/`), and an
agent's only its registration, its assignments and its reports (and read the
placements' commits). The service keeps etcd's root user: only the root role may
manage users and roles.

Names and grants are pure functions; the calls that make or remove users go
through etcd's Auth API (`Etcd.auth_api`), as a user with the root role.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pyetcd import etcdrpc

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError, EtcdRefused
from coordinator.etcd.names import check_name
from coordinator.etcd.txn import prefix_end
from coordinator.files import write_private
from coordinator.keys import JobKeys, Keys

ROOT = "root"  # etcd's own name for the user (and role) that may do anything

_PERMISSIONS = {
    "read": etcdrpc.Permission.READ,
    "write": etcdrpc.Permission.WRITE,
    "readwrite": etcdrpc.Permission.READWRITE,
}


@dataclass(frozen=True)
class Credentials:
    """An etcd user and its password (never shown by repr)."""

    user: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class Grant:
    """A permission on one key, or on every key under a prefix."""

    key: str
    prefix: bool
    permission: Literal["read", "write", "readwrite"] = "readwrite"


class CannotManageUsers(EtcdError):
    """The client's etcd user may not make users and roles (it lacks the root role)."""


# -- names (pure) -------------------------------------------------------------------------


def job_user(namespace: str, job_id: str) -> str:
    """The user (and role) of a job's members: named after the prefix they may touch."""
    return JobKeys(namespace, check_name("job id", job_id)).job.removesuffix("/")


def job_grants(namespace: str, job_id: str) -> list[Grant]:
    # The trailing slash: without it the role would cover `<job>-other/` too.
    return [Grant(JobKeys(namespace, check_name("job id", job_id)).job, prefix=True)]


def job_of_user(namespace: str, user: str) -> str | None:
    """The job a user was made for, or None for any other user."""
    job_id = user.removeprefix(Keys(namespace).jobs)
    return job_id if job_id != user and "/" not in job_id else None


def agent_user(namespace: str, agent_id: str) -> str:
    return Keys(namespace).agent(check_name("agent id", agent_id))


def agent_grants(namespace: str, agent_id: str) -> list[Grant]:
    """Its registration (created if absent, which reads it), its assignments (it deletes
    each when the member ends) and its reports; reading the placements' commits (ids,
    no secrets: a big placement's members start once theirs exists); nothing of any job
    or other agent."""
    check_name("agent id", agent_id)
    keys = Keys(namespace)
    return [
        Grant(keys.agent(agent_id), prefix=False),
        Grant(keys.assignments(agent_id), prefix=True),
        Grant(keys.reports(agent_id), prefix=True),
        Grant(keys.placements, prefix=True, permission="read"),
    ]


def new_password() -> str:
    """256 random bits."""
    return secrets.token_urlsafe(32)


def write_password_file(path: Path, password: str) -> Path:
    """Write `password` to a file only its owner may read; a missing directory is made
    for its owner alone (an existing one keeps its mode: it may be the caller's own)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(path, password + "\n")
    return path


# -- etcd's Auth API ----------------------------------------------------------------------


def _refused(exc: EtcdError, *texts: str) -> bool:
    return any(text in str(exc) for text in texts)


def _admin(etcd: Etcd, method: str, request: object, *fine: str) -> None:
    """One Auth API call; a refusal whose text is in `fine` (already so) is no error."""
    try:
        etcd.auth_api(method, request)
    except EtcdRefused as exc:
        if exc.cause != "permission-denied":
            raise
        who = etcd.security.user or "the client certificate's user"
        raise CannotManageUsers(
            f"etcd user {who!r} may not manage etcd users and roles: grant it the root "
            f"role (etcdctl user grant-role {who} root)"
        ) from exc
    except EtcdError as exc:
        if not fine or not _refused(exc, *fine):
            raise


def enable_auth(etcd: Etcd, root_password: str) -> None:
    """Turn etcd's auth on with a root user of this password; safe to repeat (a start
    that died half-way is finished; an etcd with auth on is left as it is)."""
    if etcd.auth_enabled():
        return
    try:
        etcd.auth_api("UserAdd", etcdrpc.AuthUserAddRequest(name=ROOT, password=root_password))
    except EtcdError as exc:
        if not _refused(exc, "user name already exists"):
            raise
        request = etcdrpc.AuthUserChangePasswordRequest(name=ROOT, password=root_password)
        etcd.auth_api("UserChangePassword", request)
    _admin(etcd, "RoleAdd", etcdrpc.AuthRoleAddRequest(name=ROOT), "role name already exists")
    etcd.auth_api("UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=ROOT, role=ROOT))
    etcd.auth_api("AuthEnable", etcdrpc.AuthEnableRequest())


def provision(
    etcd: Etcd, user: str, grants: list[Grant], password: str | None = None
) -> Credentials:
    """Make `user` with a role of the same name holding exactly `grants`, and `password`
    (a new one if not given); an existing one gets the password (a new attempt, a lost
    answer)."""
    password = password or new_password()
    _admin(etcd, "RoleAdd", etcdrpc.AuthRoleAddRequest(name=user), "role name already exists")
    for grant in grants:
        permission = etcdrpc.Permission(
            permType=_PERMISSIONS[grant.permission],
            key=grant.key.encode(),
            range_end=prefix_end(grant.key) if grant.prefix else b"",
        )
        request = etcdrpc.AuthRoleGrantPermissionRequest(name=user, perm=permission)
        _admin(etcd, "RoleGrantPermission", request)
    try:
        _admin(etcd, "UserAdd", etcdrpc.AuthUserAddRequest(name=user, password=password))
    except CannotManageUsers:
        raise
    except EtcdError as exc:  # (a new attempt of the job, or an earlier answer lost)
        if not _refused(exc, "user name already exists"):
            raise
        request = etcdrpc.AuthUserChangePasswordRequest(name=user, password=password)
        _admin(etcd, "UserChangePassword", request)
    _admin(etcd, "UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=user, role=user))
    return Credentials(user, password)


def revoke(etcd: Etcd, user: str) -> None:
    """Delete the user and its role; no error if they are gone already."""
    _admin(etcd, "UserDelete", etcdrpc.AuthUserDeleteRequest(name=user), "user name not found")
    _admin(etcd, "RoleDelete", etcdrpc.AuthRoleDeleteRequest(role=user), "role name not found")


def users(etcd: Etcd) -> list[str]:
    try:
        return list(etcd.auth_api("UserList", etcdrpc.AuthUserListRequest()).users)
    except EtcdRefused as exc:
        if exc.cause != "permission-denied":
            raise
        raise CannotManageUsers(f"etcd user {etcd.security.user!r} may not list users") from exc


def provision_job(etcd: Etcd, job_id: str, password: str | None = None) -> Credentials:
    """A user for the job's members: read and write `<ns>/jobs/<id>/`, nothing else."""
    user, grants = job_user(etcd.namespace, job_id), job_grants(etcd.namespace, job_id)
    return provision(etcd, user, grants, password)


def revoke_job(etcd: Etcd, job_id: str) -> None:
    revoke(etcd, job_user(etcd.namespace, job_id))


def job_users(etcd: Etcd) -> list[str]:
    """The ids of the jobs of this namespace that have a user now."""
    found = (job_of_user(etcd.namespace, user) for user in users(etcd))
    return sorted(job_id for job_id in found if job_id is not None)


def provision_agent(etcd: Etcd, agent_id: str) -> Credentials:
    """A user for one agent: its registration, assignments and reports, nothing else."""
    user = agent_user(etcd.namespace, agent_id)
    return provision(etcd, user, agent_grants(etcd.namespace, agent_id))


def revoke_agent(etcd: Etcd, agent_id: str) -> None:
    revoke(etcd, agent_user(etcd.namespace, agent_id))
