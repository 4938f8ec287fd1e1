"""What a program may ask of etcd through its member's proxy (coordinator.etcd.scope)."""

from __future__ import annotations

import pytest
from pyetcd import etcdrpc

from coordinator.etcd.scope import KV, LEASE, WATCH, Scope

PREFIX = b"/ns/jobs/j1/"
MEMBER_LEASE = 0x51


@pytest.fixture
def scope() -> Scope:
    return Scope(PREFIX, attachable=frozenset({MEMBER_LEASE}), granted={0x77})


def put(key: bytes, lease: int = 0) -> etcdrpc.RequestOp:
    return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key, lease=lease))


@pytest.mark.parametrize(
    ("key", "range_end"),
    [
        (PREFIX + b"a", b""),
        (PREFIX, b"/ns/jobs/j10"),  # exactly the prefix's end
        (PREFIX + b"x/", PREFIX + b"x0"),
    ],
)
def test_ranges_inside_the_prefix_pass(scope: Scope, key: bytes, range_end: bytes) -> None:
    assert scope.refusal(KV + "Range", etcdrpc.RangeRequest(key=key, range_end=range_end)) is None
    request = etcdrpc.DeleteRangeRequest(key=key, range_end=range_end)
    assert scope.refusal(KV + "DeleteRange", request) is None


@pytest.mark.parametrize(
    ("key", "range_end"),
    [
        (b"/ns/jobs/j2/a", b""),  # another job
        (b"/ns/jobs/j1", b""),  # the folder's own name, a key of another job's prefix set
        (b"/ns/jobs/j10/a", b""),  # a job whose id extends ours
        (PREFIX, b"\0"),  # every key from here on
        (PREFIX, b"/ns/jobs/j2/"),  # past the prefix's end
        (b"/", b"\0"),
        (b"", b""),
    ],
)
def test_ranges_outside_the_prefix_are_refused(scope: Scope, key: bytes, range_end: bytes) -> None:
    problem = scope.refusal(KV + "Range", etcdrpc.RangeRequest(key=key, range_end=range_end))
    assert problem is not None and "job's keys" in problem
    request = etcdrpc.DeleteRangeRequest(key=key, range_end=range_end)
    assert scope.refusal(KV + "DeleteRange", request) is not None
    watch = etcdrpc.WatchRequest(
        create_request=etcdrpc.WatchCreateRequest(key=key, range_end=range_end)
    )
    assert scope.refusal(WATCH, watch) is not None


def test_puts_take_no_lease_the_members_or_a_granted_one(scope: Scope) -> None:
    for lease in (0, MEMBER_LEASE, 0x77):
        assert scope.refusal(KV + "Put", etcdrpc.PutRequest(key=PREFIX + b"k", lease=lease)) is None
    problem = scope.refusal(KV + "Put", etcdrpc.PutRequest(key=PREFIX + b"k", lease=0x99))
    assert problem is not None and "lease 99" in problem
    assert scope.refusal(KV + "Put", etcdrpc.PutRequest(key=b"/ns/service/leader")) is not None


def test_transactions_are_judged_in_every_part(scope: Scope) -> None:
    inside = etcdrpc.TxnRequest(
        compare=[etcdrpc.Compare(key=PREFIX + b"a", target=etcdrpc.Compare.VERSION)],
        success=[put(PREFIX + b"a", MEMBER_LEASE)],
        failure=[etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=PREFIX + b"a"))],
    )
    assert scope.refusal(KV + "Txn", inside) is None
    outside = [
        etcdrpc.TxnRequest(compare=[etcdrpc.Compare(key=b"/ns/jobs/j2/a")]),
        etcdrpc.TxnRequest(compare=[etcdrpc.Compare(key=PREFIX, range_end=b"\0")]),
        etcdrpc.TxnRequest(success=[put(b"/ns/jobs/j2/a")]),
        etcdrpc.TxnRequest(failure=[put(PREFIX + b"a", lease=0x99)]),
        etcdrpc.TxnRequest(
            success=[
                etcdrpc.RequestOp(
                    request_delete_range=etcdrpc.DeleteRangeRequest(key=PREFIX, range_end=b"\0")
                )
            ]
        ),
        # nested: a transaction inside a transaction
        etcdrpc.TxnRequest(
            success=[
                etcdrpc.RequestOp(request_txn=etcdrpc.TxnRequest(success=[put(b"/ns/jobs/j2/a")]))
            ]
        ),
        etcdrpc.TxnRequest(success=[etcdrpc.RequestOp()]),
    ]
    for request in outside:
        assert scope.refusal(KV + "Txn", request) is not None, request


def test_watch_cancel_and_progress_pass(scope: Scope) -> None:
    cancel = etcdrpc.WatchRequest(cancel_request=etcdrpc.WatchCancelRequest(watch_id=3))
    progress = etcdrpc.WatchRequest(progress_request=etcdrpc.WatchProgressRequest())
    assert scope.refusal(WATCH, cancel) is None and scope.refusal(WATCH, progress) is None


def test_only_leases_granted_here_are_renewed_revoked_or_asked_about(scope: Scope) -> None:
    assert scope.refusal(LEASE + "LeaseGrant", etcdrpc.LeaseGrantRequest(TTL=5)) is None
    for method, message in (
        ("LeaseKeepAlive", etcdrpc.LeaseKeepAliveRequest),
        ("LeaseRevoke", etcdrpc.LeaseRevokeRequest),
        ("LeaseTimeToLive", etcdrpc.LeaseTimeToLiveRequest),
    ):
        assert scope.refusal(LEASE + method, message(ID=0x77)) is None
        # the member's own lease: the program puts keys on it, never renews it
        assert scope.refusal(LEASE + method, message(ID=MEMBER_LEASE)) is not None
        assert scope.refusal(LEASE + method, message(ID=0x1234)) is not None
    keys = etcdrpc.LeaseTimeToLiveRequest(ID=0x77, keys=True)
    assert "keys" in (scope.refusal(LEASE + "LeaseTimeToLive", keys) or "")


@pytest.mark.parametrize(
    "method",
    [
        KV + "Compact",
        LEASE + "LeaseLeases",
        "/etcdserverpb.Maintenance/Alarm",
        "/etcdserverpb.Maintenance/Status",
        "/etcdserverpb.Maintenance/Defragment",
        "/etcdserverpb.Maintenance/Snapshot",
        "/etcdserverpb.Maintenance/MoveLeader",
        "/etcdserverpb.Cluster/MemberList",
        "/etcdserverpb.Auth/Authenticate",
        "/etcdserverpb.Auth/UserList",
        "/etcdserverpb.Auth/AuthDisable",
        "/v3lockpb.Lock/Lock",
        "/v3electionpb.Election/Campaign",
        "/anything/Else",
    ],
)
def test_every_other_call_is_refused(scope: Scope, method: str) -> None:
    problem = scope.refusal(method, b"")
    assert problem is not None and "not for programs" in problem


def test_the_prefix_must_be_a_folder() -> None:
    with pytest.raises(ValueError, match="prefix"):
        Scope(b"/ns/jobs/j1")
    with pytest.raises(ValueError, match="prefix"):
        Scope(b"")
