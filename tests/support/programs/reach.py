"""A hostile `command` program: it tries what a job's etcd user could do beyond its job,
through what its member gave it, and prints one JSON line saying what each attempt got
(`allowed`, or the gRPC code that refused it), plus what it found of credentials.

VICTIM_LEASE (hex): another job's lease, to keep alive. OTHER_JOB: another job's id,
whose keys it tries to read. It then runs until RELEASE_FILE exists (at most 60 s).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import grpc
from pyetcd import etcdrpc


def attempt(call: Any, request: Any) -> str:
    try:
        result = call(request, timeout=10)
        if not hasattr(result, "header") and not isinstance(result, bytes):
            list(result)  # a stream: its answers
    except grpc.RpcError as exc:
        return exc.code().name  # type: ignore[no-any-return]
    return "allowed"


def ancestors() -> list[int]:
    """This process's parents up to init: its reaper, its member, the service."""
    found, pid = [], os.getppid()
    while pid > 1:
        found.append(pid)
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def main() -> None:
    endpoint = os.environ["COORDINATOR_ETCD"]
    namespace = os.environ["COORDINATOR_NAMESPACE"]
    victim = int(os.environ["VICTIM_LEASE"], 16)
    member_lease = int(os.environ["COORDINATOR_LEASE"], 16)
    channel = grpc.insecure_channel(endpoint)
    kv, lease = etcdrpc.KVStub(channel), etcdrpc.LeaseStub(channel)
    maintenance = etcdrpc.MaintenanceStub(channel)
    alarm = etcdrpc.AlarmRequest(action=etcdrpc.AlarmRequest.ACTIVATE, alarm=etcdrpc.NOSPACE)
    other = f"{namespace}/jobs/{os.environ['OTHER_JOB']}/".encode()
    tried = {
        "alarm": attempt(maintenance.Alarm, alarm),
        "keepalive_other": attempt(
            lease.LeaseKeepAlive, iter([etcdrpc.LeaseKeepAliveRequest(ID=victim)])
        ),
        "keepalive_member": attempt(
            lease.LeaseKeepAlive, iter([etcdrpc.LeaseKeepAliveRequest(ID=member_lease)])
        ),
        "lease_list": attempt(channel.unary_unary("/etcdserverpb.Lease/LeaseLeases"), b""),
        "lease_keys": attempt(
            lease.LeaseTimeToLive, etcdrpc.LeaseTimeToLiveRequest(ID=victim, keys=True)
        ),
        "compact": attempt(kv.Compact, etcdrpc.CompactionRequest(revision=1)),
        "all_keys": attempt(kv.Range, etcdrpc.RangeRequest(key=b"\0", range_end=b"\0")),
        "other_job": attempt(kv.Range, etcdrpc.RangeRequest(key=other, range_end=b"\0")),
        "auth_users": attempt(etcdrpc.AuthStub(channel).UserList, etcdrpc.AuthUserListRequest()),
        "members": attempt(etcdrpc.ClusterStub(channel).MemberList, etcdrpc.MemberListRequest()),
    }
    # What it holds: its environment, and the command lines of its ancestors.
    etcd_settings = sorted(
        name for name in os.environ if name.startswith("COORDINATOR_ETCD") and name not in
        ("COORDINATOR_ETCD", "COORDINATOR_ETCD_WAIT")
    )  # fmt: skip
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                for pid in ancestors()]  # fmt: skip
    print(json.dumps({"reach": tried, "etcd_settings": etcd_settings, "endpoint": endpoint,
                      "cmdlines": cmdlines, "environ": dict(os.environ)}), flush=True)  # fmt: skip
    # Running on until the test has read the member's password file (gone when it ends).
    release = Path(os.environ["RELEASE_FILE"])
    deadline = time.monotonic() + 60
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
