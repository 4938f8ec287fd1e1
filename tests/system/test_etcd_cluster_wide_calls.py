"""etcd's calls that skip key permissions, on the embedded etcd with auth on (issue 28, item 2).

etcd 3.5.1 checks a user's key permissions on KV and watch calls, but answers some
cluster-wide calls for anyone who reaches its client port, with no credentials at
all: raising and disarming a NOSPACE alarm (every write then fails), listing the
leases, keeping any lease alive (a frozen member, or a stale service leader, stays
"alive"), a lease's key names (CVE-2023-32082: every key name in etcd), granting
leases, compacting. So the embedded etcd's client port wants a client certificate
(`coordinator/etcd/local_pki.py`): a caller without one, even one that trusts etcd's
CA, gets no call through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from pyetcd import etcdrpc

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd

pytestmark = pytest.mark.one_etcd


@pytest.fixture
def own_etcd() -> Iterator[EmbeddedEtcd]:
    """An etcd of this test's own (auth on, as every embedded one): an alarm raised here
    stops no other test's writes."""
    with EmbeddedEtcd() as server:
        yield server


def _raw(channel: grpc.Channel, method: str) -> Callable[[bytes], bytes]:
    """A call etcd has that our client's stubs lack (LeaseLeases), on raw bytes."""
    return channel.unary_unary(
        method, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )


def _answered(call: Callable[[], Any]) -> bool:
    try:
        call()
    except grpc.RpcError:
        return False
    return True


def test_a_caller_without_credentials_reaches_no_cluster_wide_call(
    own_etcd: EmbeddedEtcd,
) -> None:
    with Etcd(own_etcd.endpoint, namespace="", security=own_etcd.security) as root:
        lease = root.grant_lease(60)
        root.put("/secret/job-names/hidden", "x", lease=lease)
        revision = root.put("/k", "v")
    # No token, no client certificate; etcd's own CA trusted (more than a stranger has).
    ca = own_etcd.security.ca
    assert ca is not None and own_etcd.endpoint.startswith("https://")
    trust = grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes())
    channel = grpc.secure_channel(own_etcd.endpoint.removeprefix("https://"), trust)
    try:
        leases, maintenance, kv = (
            etcdrpc.LeaseStub(channel),
            etcdrpc.MaintenanceStub(channel),
            etcdrpc.KVStub(channel),
        )
        nospace = etcdrpc.AlarmRequest(action=1, memberID=0, alarm=etcdrpc.AlarmType.NOSPACE)
        disarm = etcdrpc.AlarmRequest(action=2, memberID=0, alarm=etcdrpc.AlarmType.NOSPACE)

        def key_names() -> None:
            answer = leases.LeaseTimeToLive(
                etcdrpc.LeaseTimeToLiveRequest(ID=lease, keys=True), timeout=5
            )
            assert answer.keys, "no key names"

        def keep_alive() -> None:
            (answer,) = list(
                leases.LeaseKeepAlive(iter([etcdrpc.LeaseKeepAliveRequest(ID=lease)]), timeout=5)
            )
            assert answer.TTL > 0, "not kept alive"

        calls: dict[str, Callable[[], Any]] = {
            "KV.Range (the control: refused)": lambda: kv.Range(
                etcdrpc.RangeRequest(key=b"/k"), timeout=5
            ),
            "Maintenance.Alarm(ACTIVATE, NOSPACE)": lambda: maintenance.Alarm(nospace, timeout=5),
            "Maintenance.Alarm(DEACTIVATE)": lambda: maintenance.Alarm(disarm, timeout=5),
            "Lease.LeaseLeases": lambda: _raw(channel, "/etcdserverpb.Lease/LeaseLeases")(
                b"", timeout=5
            ),
            "Lease.LeaseTimeToLive(keys=true)": key_names,
            "Lease.LeaseKeepAlive (another's lease)": keep_alive,
            "Lease.LeaseGrant": lambda: leases.LeaseGrant(
                etcdrpc.LeaseGrantRequest(TTL=60), timeout=5
            ),
            "KV.Compact": lambda: kv.Compact(
                etcdrpc.CompactionRequest(revision=revision), timeout=5
            ),
        }
        answered = [name for name, call in calls.items() if _answered(call)]
    finally:
        channel.close()
    assert "KV.Range (the control: refused)" not in answered  # auth is on
    assert answered == []
