"""What a member container of the docker launcher is given, decided without the
engine: least privilege and limits, the etcd endpoints it reaches, a `command` job's
program settings, and which of the service's etcd settings it inherits.

Every member container runs with the least privilege compose gives its containers
(`member_hardening`): the image's non-root user 10001, a read-only root filesystem
(writable: a tmpfs at /tmp and the artifacts volume at /artifacts), no capabilities,
no-new-privileges, and a limit on its processes and its memory (`--docker-pids-limit`,
`--docker-memory`). Of the service's etcd settings a member gets only the TLS files
(CA, client certificate), not the service's own user, unless its job has no user of
its own (`etcd_settings`).
"""

from __future__ import annotations

import re
from typing import Any

from coordinator.etcd.security import ENV, EtcdSecurity
from coordinator.jobs.kinds import kind_of
from coordinator.rendezvous.address import endpoint_host, is_loopback
from coordinator.service.model import JobSpec

#: The image's user (worker_image/Dockerfile), as compose runs it.
MEMBER_USER = "10001:10001"
MEMBER_UID = 10001
#: Where a member finds its per-job etcd password (a read-only bind mount).
MEMBER_PASSWORD_FILE = "/run/secrets/etcd-password"
#: The artifacts volume (a named volume, or an absolute host path) mounted at /artifacts.
DEFAULT_ARTIFACTS = "etcd-coordinator-artifacts"
DEFAULT_MEMORY = "2g"  # mnist with PyTorch, the largest job, stays well under it
DEFAULT_PIDS_LIMIT = 1024  # threads count: PyTorch and gRPC start dozens per process


_MEMORY = re.compile(r"^[1-9][0-9]*[bkmg]?$", re.IGNORECASE)


def check_limits(memory: str, pids_limit: int) -> None:
    """Refuse limits the engine would take badly, naming the option."""
    if not _MEMORY.match(memory):
        raise ValueError(f"--docker-memory {memory!r}: expected a size such as 2g or 512m")
    if pids_limit < 1:
        raise ValueError(f"--docker-pids-limit {pids_limit}: must be at least 1")


def member_hardening(memory: str, pids_limit: int, artifacts: str) -> dict[str, Any]:
    """The docker SDK settings of a member container: the least privilege compose gives
    its containers (docs/compose.md), and limits on its processes and memory."""
    return {
        "user": MEMBER_USER,
        "read_only": True,
        "tmpfs": {"/tmp": "rw,nosuid,nodev"},
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
        "pids_limit": pids_limit,
        "mem_limit": memory,
        "memswap_limit": memory,  # no swap beyond the memory limit
        "volumes": {artifacts: {"bind": "/artifacts", "mode": "rw"}},
    }


def container_endpoints(service_etcd: str, seen_from_containers: str | None) -> str:
    """The etcd endpoints to give containers: `seen_from_containers` if given, else the
    service's own, which must then not be loopback (a container's loopback is its own)."""
    if seen_from_containers:
        return seen_from_containers
    loopback = [e for e in service_etcd.split(",") if e.strip() and is_loopback(endpoint_host(e))]
    if loopback:
        raise ValueError(
            f"etcd at {', '.join(loopback)} is loopback, which containers cannot reach: "
            "give --etcd at an address they reach, or --docker-etcd HOST:PORT as they see it"
        )
    return service_etcd


def program_settings(spec: JobSpec) -> dict[str, Any]:
    """A `command` member's container settings: the image's `coordinator` as its process
    (whatever the image's own entrypoint), the job's `env` in its environment, its
    `working_dir` as the container's (a folder inside the image). Nothing for other kinds."""
    if not kind_of(spec.kind).takes_command:
        return {}
    settings: dict[str, Any] = {"entrypoint": ["coordinator"], "environment": dict(spec.env)}
    if spec.working_dir:
        settings["working_dir"] = spec.working_dir
    return settings


def etcd_settings(own_user: bool) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The service's etcd settings for a member container: the variables, and each file
    mounted read-only at the same path (uid 10001 must be able to read it). The TLS files
    always; the service's own user and password file only with `own_user`, when the job
    has no user of its own (an etcd without auth has none to pass, and a service that may
    not make users lends its own, as the local launcher does)."""
    security = EtcdSecurity.from_env()
    environment: dict[str, str] = {}
    files: dict[str, dict[str, str]] = {}
    for name in ENV if own_user else ("ca", "cert", "key"):
        value = getattr(security, name)
        if value:
            environment[ENV[name]] = value
            if name != "user":
                files[value] = {"bind": value, "mode": "ro"}
    return environment, files
