"""What a job's program may ask of etcd through its member's proxy: a pure decision.

A `command` program runs code nobody vetted. Its member holds the job's etcd
credentials, and etcd checks only *key* permissions: calls that touch no key
(alarms, compaction, listing leases, keeping any lease alive, a lease's keys,
users and roles) pass for any authenticated user. So the program never gets
the credentials; it talks to a proxy its member runs (`coordinator.etcd.proxy`),
which forwards only what `refusal` allows:

- KV Range, Put, DeleteRange and Txn (compares and nested ops included) and
  Watch, on keys under the job's own prefix;
- Put with no lease, the member's lease, or a lease this proxy granted;
- LeaseGrant; LeaseRevoke, LeaseKeepAlive and LeaseTimeToLive (without keys)
  only of leases this proxy granted.

Everything else is refused: Compact, the Maintenance, Cluster and Auth services,
LeaseLeases, TimeToLive with keys, ranges that end past the prefix or at `\\0`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pyetcd import etcdrpc

from coordinator.etcd.txn import prefix_end

KV = "/etcdserverpb.KV/"
LEASE = "/etcdserverpb.Lease/"
WATCH = "/etcdserverpb.Watch/Watch"

#: Unary methods a program may call (each checked further by `refusal`), with their
#: request message.
UNARY: dict[str, type] = {
    KV + "Range": etcdrpc.RangeRequest,
    KV + "Put": etcdrpc.PutRequest,
    KV + "DeleteRange": etcdrpc.DeleteRangeRequest,
    KV + "Txn": etcdrpc.TxnRequest,
    LEASE + "LeaseGrant": etcdrpc.LeaseGrantRequest,
    LEASE + "LeaseRevoke": etcdrpc.LeaseRevokeRequest,
    LEASE + "LeaseTimeToLive": etcdrpc.LeaseTimeToLiveRequest,
}
#: Streaming methods (both ends stream), each request of the stream checked.
STREAMS: dict[str, type] = {
    WATCH: etcdrpc.WatchRequest,
    LEASE + "LeaseKeepAlive": etcdrpc.LeaseKeepAliveRequest,
}


@dataclass
class Scope:
    """The keys and leases one program may touch.

    `prefix`: the job's keys (`<namespace>/jobs/<job>/`). `attachable`: leases keys
    may be put on (the member's own, which the program uses but never renews).
    `granted`: leases the proxy granted for this program (filled as it grants them);
    only those may be renewed, revoked or asked about, and keys may be put on them.
    """

    prefix: bytes
    attachable: frozenset[int] = frozenset()
    granted: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.prefix or not self.prefix.endswith(b"/"):
            raise ValueError(f"scope prefix {self.prefix!r} must be a folder (end in /)")

    @property
    def end(self) -> bytes:
        return prefix_end(self.prefix.decode())

    # -- pieces --------------------------------------------------------------

    def key_problem(self, key: bytes, range_end: bytes = b"") -> str | None:
        """Why [key, range_end) is not inside the prefix (None: it is). An empty
        `range_end` is the one key; `\\0` would be every key from `key` on."""
        if not key.startswith(self.prefix):
            return f"key {_show(key)} is outside this job's keys {_show(self.prefix)}"
        if range_end and (range_end == b"\0" or range_end > self.end):
            return f"range to {_show(range_end)} reaches past this job's keys {_show(self.prefix)}"
        return None

    def lease_problem(self, lease: int, *, attach: bool) -> str | None:
        """Why the program may not use lease `lease` (None: it may). `attach`: only to
        put keys on it (no lease, the member's, or one granted here)."""
        if attach and (lease == 0 or lease in self.attachable):
            return None
        if lease in self.granted:
            return None
        return f"lease {lease:x} was not granted through this proxy"

    def txn_problem(self, txn: Any) -> str | None:
        for compare in txn.compare:
            problem = self.key_problem(compare.key, compare.range_end)
            if problem:
                return problem
        for op in (*txn.success, *txn.failure):
            problem = self.op_problem(op)
            if problem:
                return problem
        return None

    def op_problem(self, op: Any) -> str | None:
        kind = op.WhichOneof("request")
        if kind == "request_range":
            return self.key_problem(op.request_range.key, op.request_range.range_end)
        if kind == "request_put":
            return self.put_problem(op.request_put)
        if kind == "request_delete_range":
            r = op.request_delete_range
            return self.key_problem(r.key, r.range_end)
        if kind == "request_txn":
            return self.txn_problem(op.request_txn)
        return "an empty transaction operation"

    def put_problem(self, put: Any) -> str | None:
        return self.key_problem(put.key) or self.lease_problem(put.lease, attach=True)

    def watch_problem(self, request: Any) -> str | None:
        if request.HasField("create_request"):
            create = request.create_request
            return self.key_problem(create.key, create.range_end)
        return None  # cancelling its own watch, or asking for progress

    # -- the decision ----------------------------------------------------------

    def refusal(self, method: str, request: Any) -> str | None:
        """Why this call (full gRPC method name, parsed request) is refused; None when
        it may be forwarded. For a stream, `request` is one of its requests."""
        name = method.rsplit("/", 1)[-1]
        if method == KV + "Range":
            return self.key_problem(request.key, request.range_end)
        if method == KV + "Put":
            return self.put_problem(request)
        if method == KV + "DeleteRange":
            return self.key_problem(request.key, request.range_end)
        if method == KV + "Txn":
            return self.txn_problem(request)
        if method == WATCH:
            return self.watch_problem(request)
        if method == LEASE + "LeaseGrant":
            return None
        if method in (LEASE + "LeaseRevoke", LEASE + "LeaseKeepAlive"):
            return self.lease_problem(request.ID, attach=False)
        if method == LEASE + "LeaseTimeToLive":
            if request.keys:
                return "a lease's keys are not for programs (TimeToLive with keys)"
            return self.lease_problem(request.ID, attach=False)
        return f"{name} is not for programs: only the job's keys, watches and own leases are"


def _show(key: bytes) -> str:
    text = key[:80].decode(errors="replace")
    return repr(text + ("..." if len(key) > 80 else ""))
