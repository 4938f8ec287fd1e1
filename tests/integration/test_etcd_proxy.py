"""A program's etcd proxy against a real etcd: what the scope allows works, the rest
is refused before etcd sees it (the proxy forwards as root here, so every refusal
below is the proxy's own, not etcd's)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pyetcd import etcdrpc

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdRefused
from coordinator.etcd.proxy import EtcdProxy
from coordinator.etcd.scope import Scope
from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.etcd.watch import WatchEvent
from tests.support.wait import wait_until

JOB = "j1"


class Setup:
    def __init__(self, upstream: Etcd, proxy: EtcdProxy, member_lease: int) -> None:
        self.upstream, self.proxy, self.member_lease = upstream, proxy, member_lease
        self.prefix = upstream.key("jobs", JOB, "")
        self.channel = grpc.insecure_channel(proxy.endpoint)
        self.kv = etcdrpc.KVStub(self.channel)
        self.lease = etcdrpc.LeaseStub(self.channel)
        self.maintenance = etcdrpc.MaintenanceStub(self.channel)
        self.auth = etcdrpc.AuthStub(self.channel)
        self.cluster = etcdrpc.ClusterStub(self.channel)
        self.watch = etcdrpc.WatchStub(self.channel)

    def program(self) -> Etcd:
        """A program's client, as `coordinator.context()` makes it: no credentials."""
        return Etcd(
            self.proxy.endpoint,
            namespace=self.upstream.namespace,
            probe=f"jobs/{JOB}/",
            security=EtcdSecurity(),
            connect_timeout=5,
        )


@pytest.fixture
def setup(etcd_server: EmbeddedEtcd, etcd: Etcd) -> Iterator[Setup]:
    folder = Path(tempfile.mkdtemp(prefix="pxy-"))  # (short: a socket path fits 100 bytes)
    member_lease = etcd.grant_lease(30)
    scope = Scope(etcd.key("jobs", JOB, "").encode(), attachable=frozenset({member_lease}))
    proxy = EtcdProxy(etcd, scope, folder / "etcd.sock").start()
    made = Setup(etcd, proxy, member_lease)
    try:
        yield made
    finally:
        made.channel.close()
        proxy.close()
        etcd.revoke_lease(member_lease)
        shutil.rmtree(folder, ignore_errors=True)


def refused(call: object, *args: object, **kwargs: object) -> str:
    """The details of the PERMISSION_DENIED the call must end with."""
    with pytest.raises(grpc.RpcError) as caught:
        result = call(*args, timeout=5, **kwargs)  # type: ignore[operator]
        if not hasattr(result, "header"):  # a stream: read it
            list(result)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value
    details = caught.value.details()
    assert "coordinator proxy" in details
    return details


def test_the_socket_is_the_owners_alone(setup: Setup) -> None:
    mode = os.stat(setup.proxy.socket_path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_a_program_uses_its_jobs_keys_watches_and_leases(setup: Setup) -> None:
    with setup.program() as program:
        key = setup.prefix + "a"
        program.put(key, "1", lease=setup.member_lease)  # on the member's lease
        assert program.get(key).value == b"1"  # type: ignore[union-attr]
        created, _, count = program.create(setup.prefix + "b", "2", count_prefix=setup.prefix)
        assert created and count == 2
        seen: list[WatchEvent] = []
        watch = program.watch(setup.prefix, seen.extend, 0, prefix=True)
        try:
            program.put(setup.prefix + "c", "3")
            wait_until(lambda: any(e.key.endswith("/c") for e in seen), 10, "the watch's event")
        finally:
            watch.cancel()
        lease = program.grant_lease(10)
        assert program.keepalive(lease) > 0
        program.put(setup.prefix + "d", "4", lease=lease)
        program.revoke_lease(lease)
        assert setup.upstream.get(setup.prefix + "d") is None  # gone with its lease
        assert program.delete_prefix(setup.prefix) == 3
    assert setup.proxy.refused == 0


def test_cluster_wide_calls_are_refused(setup: Setup) -> None:
    alarm = etcdrpc.AlarmRequest(
        action=etcdrpc.AlarmRequest.ACTIVATE, memberID=0, alarm=etcdrpc.NOSPACE
    )
    details = refused(setup.maintenance.Alarm, alarm)
    assert "Alarm" in details
    # (etcd never saw it: no alarm is raised)
    with Etcd(setup.upstream.urls, namespace="") as root:
        listed = etcdrpc.MaintenanceStub(root.calls_channel()).Alarm(
            etcdrpc.AlarmRequest(action=etcdrpc.AlarmRequest.GET), timeout=5
        )
        assert list(listed.alarms) == []
    refused(setup.maintenance.Status, etcdrpc.StatusRequest())
    refused(setup.maintenance.Defragment, etcdrpc.DefragmentRequest())
    refused(setup.maintenance.Snapshot, etcdrpc.SnapshotRequest())
    refused(setup.kv.Compact, etcdrpc.CompactionRequest(revision=1))
    # (the library's stubs predate LeaseLeases: called by name, its request is empty)
    refused(setup.channel.unary_unary("/etcdserverpb.Lease/LeaseLeases"), b"")
    refused(setup.cluster.MemberList, etcdrpc.MemberListRequest())
    refused(setup.auth.UserList, etcdrpc.AuthUserListRequest())
    refused(setup.auth.Authenticate, etcdrpc.AuthenticateRequest(name="root", password="x"))
    refused(setup.auth.AuthDisable, etcdrpc.AuthDisableRequest())


def test_leases_the_proxy_did_not_grant_are_out_of_reach(setup: Setup) -> None:
    other = setup.upstream.grant_lease(30)  # another job's, say
    try:
        for lease in (other, setup.member_lease):
            refused(setup.lease.LeaseKeepAlive, iter([etcdrpc.LeaseKeepAliveRequest(ID=lease)]))
            refused(setup.lease.LeaseRevoke, etcdrpc.LeaseRevokeRequest(ID=lease))
            refused(setup.lease.LeaseTimeToLive, etcdrpc.LeaseTimeToLiveRequest(ID=lease))
            put = etcdrpc.PutRequest(key=(setup.prefix + "x").encode(), lease=other)
            refused(setup.kv.Put, put)
        with setup.program() as program:
            mine = program.grant_lease(10)
            # its own lease, yes; but never with the keys (CVE-2023-32082's listing)
            ttl = etcdrpc.LeaseTimeToLiveRequest(ID=mine)
            assert setup.lease.LeaseTimeToLive(ttl, timeout=5).TTL > 0
            keys = etcdrpc.LeaseTimeToLiveRequest(ID=mine, keys=True)
            assert "keys" in refused(setup.lease.LeaseTimeToLive, keys)
    finally:
        setup.upstream.revoke_lease(other)


def test_keys_outside_the_jobs_prefix_are_refused(setup: Setup) -> None:
    setup.upstream.put(setup.upstream.key("jobs", "j2", "secret"), "other job's")
    outside = [
        etcdrpc.RangeRequest(key=setup.upstream.key("jobs", "j2", "secret").encode()),
        etcdrpc.RangeRequest(key=b"\0", range_end=b"\0"),  # every key
        etcdrpc.RangeRequest(key=setup.prefix.encode(), range_end=b"\0"),
    ]
    for request in outside:
        refused(setup.kv.Range, request)
    refused(setup.kv.Put, etcdrpc.PutRequest(key=setup.upstream.key("service").encode()))
    refused(setup.kv.DeleteRange, etcdrpc.DeleteRangeRequest(key=b"\0", range_end=b"\0"))
    txn = etcdrpc.TxnRequest(
        success=[
            etcdrpc.RequestOp(
                request_range=etcdrpc.RangeRequest(key=setup.upstream.key("jobs").encode())
            )
        ]
    )
    refused(setup.kv.Txn, txn)
    create = etcdrpc.WatchCreateRequest(key=b"\0", range_end=b"\0")
    refused(setup.watch.Watch, iter([etcdrpc.WatchRequest(create_request=create)]))
    assert setup.upstream.get(setup.upstream.key("jobs", "j2", "secret")) is not None


def test_a_refused_watch_ends_only_its_own_stream(setup: Setup) -> None:
    """A stream whose later request is refused ends; the program's other calls go on."""
    inside = etcdrpc.WatchCreateRequest(key=setup.prefix.encode())
    outside = etcdrpc.WatchCreateRequest(key=b"/", range_end=b"\0")
    release = threading.Event()

    def requests() -> Iterator[etcdrpc.WatchRequest]:
        yield etcdrpc.WatchRequest(create_request=inside)
        release.wait(5)
        yield etcdrpc.WatchRequest(create_request=outside)

    stream = setup.watch.Watch(requests(), timeout=10)
    first = next(stream)
    assert first.created
    release.set()
    with pytest.raises(grpc.RpcError) as caught:
        list(stream)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with setup.program() as program:
        program.put(setup.prefix + "after", "x")


def test_the_proxy_revokes_the_leases_it_granted_when_it_closes(setup: Setup) -> None:
    with setup.program() as program:
        lease = program.grant_lease(60)
        program.put(setup.prefix + "held", "x", lease=lease)
    setup.proxy.close()
    assert setup.upstream.get(setup.prefix + "held") is None
    assert setup.upstream.keepalive(lease) == 0  # (gone)


def test_a_program_is_told_its_member_refused_and_why(setup: Setup) -> None:
    with setup.program() as program, pytest.raises(EtcdRefused) as caught:
        program.get(setup.upstream.key("jobs", "j2", "a"))
    message = str(caught.value)
    assert "this program's member" in message and "outside this job's keys" in message


def test_a_program_holds_a_bounded_number_of_leases(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("coordinator.etcd.proxy.MAX_LEASES", 2)
    with setup.program() as program:
        program.grant_lease(10)
        program.grant_lease(10)
        with pytest.raises(EtcdRefused, match="at most 2 leases"):
            program.grant_lease(10)
