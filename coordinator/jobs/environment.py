"""What the `command` kind tells a user's program: its environment and its roster file.

Pure functions of the roster and the member's settings, so the contract (torch's
env:// variables plus ours, see docs/programs.md's table) is one place and testable
without processes. The round's secret never reaches either: the roster file is
built from `model_dump`, which leaves it out.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator.etcd.security import ENV as ETCD_SECURITY_ENV
from coordinator.rendezvous.roster import Roster

#: Variables a program gets from its member beyond the member's own environment.
CONTRACT = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "COORDINATOR_JOB", "COORDINATOR_RANK", "COORDINATOR_WORLD_SIZE", "COORDINATOR_ROSTER",
    "COORDINATOR_ARTIFACTS", "COORDINATOR_ETCD", "COORDINATOR_NAMESPACE",
    "COORDINATOR_ROUND", "COORDINATOR_LEASE", "COORDINATOR_REPORTS_FD",
    "COORDINATOR_ETCD_WAIT",
)  # fmt: skip


#: How the service hands a `command` member its program's extra variables (JSON) and
#: folder: through the member's environment, never argv (values may be secrets). The
#: member takes both out before anything else sees its environment.
PROGRAM_ENV = "COORDINATOR_PROGRAM_ENV"
PROGRAM_DIR = "COORDINATOR_PROGRAM_DIR"
#: The member's GPU ids (comma-separated, set by its launcher), which its program sees as
#: CUDA_VISIBLE_DEVICES: declared ids are the truth, nothing is probed.
GPUS_ENV = "COORDINATOR_GPUS"
#: Where a program's folder must lie (os.pathsep between several), set by `serve`.
WORKING_DIR_ROOT_ENV = "COORDINATOR_WORKING_DIR_ROOT"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MAX_ENV_ENTRIES = 128
MAX_ENV_VALUE = 8192


def check_program_env(env: Mapping[str, str]) -> dict[str, str]:
    """A submitted program's variables, or ValueError naming the bad ones: valid names,
    bounded, and none the member sets itself (the contract, COORDINATOR_*)."""
    if len(env) > MAX_ENV_ENTRIES:
        raise ValueError(f"at most {MAX_ENV_ENTRIES} variables")
    bad = [name for name in env if not ENV_NAME.match(name)]
    if bad:
        raise ValueError(f"not variable names: {', '.join(repr(n[:40]) for n in bad[:5])}")
    reserved = sorted(n for n in env if n in CONTRACT or n.startswith("COORDINATOR_"))
    if reserved:
        raise ValueError(f"{', '.join(reserved)}: set by the member itself (see the contract)")
    long = [name for name, value in env.items() if not isinstance(value, str) or "\0" in value
            or len(value) > MAX_ENV_VALUE]  # fmt: skip
    if long:
        raise ValueError(f"{', '.join(long)}: values are text of at most {MAX_ENV_VALUE} chars")
    return dict(env)


def local_ranks(roster: Roster, rank: int) -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE): this member's place among those on its host
    (same hostname in the roster), ordered by rank."""
    hostname = roster.members[rank].hostname
    same_host = [m.rank for m in roster.members if m.hostname == hostname]
    return same_host.index(rank), len(same_host)


def roster_document(roster: Roster, ports: Mapping[int, int]) -> dict[str, Any]:
    """The roster file's content: every member's rank, address, host and reserved port."""
    return {
        "job_id": roster.job_id,
        "round": roster.round,
        "world_size": roster.world_size,
        "master": {"addr": roster.leader.host, "port": ports[0]},
        "members": [
            {
                "rank": m.rank,
                "address": m.host,
                "endpoint_port": m.port,
                "hostname": m.hostname,
                "pid": m.pid,
                "reserved_ports": [ports[m.rank]],
            }
            for m in roster.members
        ],
    }


def program_environment(
    base: Mapping[str, str],
    *,
    roster: Roster,
    rank: int,
    ports: Mapping[int, int],
    roster_file: Path,
    artifacts: Path,
    etcd_endpoints: str,
    namespace: str,
    lease: int | None = None,
    etcd_wait: float | None = None,
) -> dict[str, str]:
    """The member's environment with the contract's variables set (ours win over inherited
    ones of the same name). None of the member's etcd settings pass (user, password file,
    CA, certificate, key): `etcd_endpoints` is the member's proxy (`unix:<socket>`,
    coordinator.etcd.proxy), which holds them and forwards only the job's own calls.

    `lease` is the member's etcd lease (COORDINATOR_LEASE, hex): `coordinator.context()`
    binds the program's barrier keys to it, so they live exactly as long as the member.
    `etcd_wait` (COORDINATOR_ETCD_WAIT, seconds): how long the member's own requests wait
    for etcd; the program's wait as long, so an outage its member rides out it does too."""
    local_rank, local_world = local_ranks(roster, rank)
    env = {k: v for k, v in base.items() if k not in CONTRACT}
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(roster.world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_world),
        MASTER_ADDR=roster.leader.host,
        MASTER_PORT=str(ports[0]),
        COORDINATOR_JOB=roster.job_id,
        COORDINATOR_RANK=str(rank),
        COORDINATOR_WORLD_SIZE=str(roster.world_size),
        COORDINATOR_ROSTER=str(roster_file),
        COORDINATOR_ARTIFACTS=str(artifacts),
        COORDINATOR_ETCD=etcd_endpoints,
        COORDINATOR_NAMESPACE=namespace,
        COORDINATOR_ROUND=str(roster.round),
    )
    if lease is not None:
        env["COORDINATOR_LEASE"] = f"{lease:x}"
    if etcd_wait is not None:
        env["COORDINATOR_ETCD_WAIT"] = f"{etcd_wait:g}"
    for var in ETCD_SECURITY_ENV.values():
        env.pop(var, None)
    if env.get(GPUS_ENV):  # the member's GPUs win over an inherited or submitted setting
        env["CUDA_VISIBLE_DEVICES"] = env[GPUS_ENV]
    return env


def describe_status(returncode: int) -> str:
    """A finished program's status in words: `exited with code 7`, `was killed by SIGKILL`."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"
