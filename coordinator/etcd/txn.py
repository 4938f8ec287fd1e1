"""A transaction's parts as values: conditions, operations and the result.

A transaction runs its operations if every condition holds, else its other
operations (etcd's If/Then/Else): `Etcd.transaction(then, when=..., otherwise=...)`.
Every transaction of the product is built from these, so a guard reads the same
wherever it is used (`When` nests one transaction in another); the client's shortcuts
(`create`, `replace`, `delete_if`, `put_and_count`) answer with the named results below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from pyetcd import etcdrpc


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def key_value(kv: etcdrpc.KeyValue) -> KeyValue:
    return KeyValue(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision, kv.lease)


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool  # whether the conditions held
    revision: int
    reads: list[KeyValue | None]  # one per `First` or `Get` of the branch that ran, in order
    counts: list[int] = field(default_factory=list)  # one per `Count`, in order


class Created(NamedTuple):
    """`Etcd.create`'s answer."""

    created: bool  # by this call, or by an earlier attempt of it whose answer was lost
    current: KeyValue  # the key as it now is
    count: int  # keys under the `count_prefix` just after (0 without one)


class Replaced(NamedTuple):
    """`Etcd.replace`'s answer."""

    written: bool
    current: KeyValue | None  # the key when it was not written (None: gone, or written)
    revision: int  # the write's own when written, else the one answered at


class Deleted(NamedTuple):
    """`Etcd.delete_if`'s answer."""

    deleted: bool
    revision: int


class Counted(NamedTuple):
    """`Etcd.put_and_count`'s answer."""

    revision: int  # of the write
    count: int  # keys under the prefix just after it


def to_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def prefix_end(prefix: str) -> bytes:
    """The range end that selects every key starting with `prefix`."""
    raw = bytearray(prefix.encode())
    for i in reversed(range(len(raw))):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


# -- conditions: each fills an `etcdrpc.Compare` in place (`fill`) --------------------


class _Condition:
    def fill(self, compare: etcdrpc.Compare) -> None:
        raise NotImplementedError

    def compare(self) -> etcdrpc.Compare:
        compare = etcdrpc.Compare()
        self.fill(compare)
        return compare


_RELATIONS = {
    "<": etcdrpc.Compare.LESS,
    "=": etcdrpc.Compare.EQUAL,
    ">": etcdrpc.Compare.GREATER,
}


@dataclass(frozen=True)
class ValueIs(_Condition):
    """A condition: `key` exists and its value is `<`, `=` or `>` `than` (as bytes)."""

    key: str
    relation: Literal["<", "=", ">"]
    than: bytes | str

    def fill(self, compare: etcdrpc.Compare) -> None:
        compare.key, compare.result = self.key.encode(), _RELATIONS[self.relation]
        compare.target, compare.value = etcdrpc.Compare.VALUE, to_bytes(self.than)


@dataclass(frozen=True)
class CreatedAt(_Condition):
    """`key` exists and is the version created at `revision` (not a successor)."""

    key: str
    revision: int

    def fill(self, compare: etcdrpc.Compare) -> None:
        compare.key, compare.result = self.key.encode(), etcdrpc.Compare.EQUAL
        compare.target, compare.create_revision = etcdrpc.Compare.CREATE, self.revision


@dataclass(frozen=True)
class QuietSince(_Condition):
    """No key under `prefix` was written after `revision` (deletions aside)."""

    prefix: str
    revision: int

    def fill(self, compare: etcdrpc.Compare) -> None:
        compare.key, compare.range_end = self.prefix.encode(), prefix_end(self.prefix)
        compare.result, compare.target = etcdrpc.Compare.LESS, etcdrpc.Compare.MOD
        compare.mod_revision = self.revision + 1


@dataclass(frozen=True)
class Unchanged(_Condition):
    """`key` is still at `mod_revision` (0: it does not exist)."""

    key: str
    mod_revision: int

    def fill(self, compare: etcdrpc.Compare) -> None:
        compare.key, compare.result = self.key.encode(), etcdrpc.Compare.EQUAL
        compare.target, compare.mod_revision = etcdrpc.Compare.MOD, self.mod_revision


@dataclass(frozen=True)
class Empty(_Condition):
    """No key in `[start, end)` (`end` exclusive, as bytes: `prefix_end` for a prefix)."""

    start: str
    end: bytes

    def fill(self, compare: etcdrpc.Compare) -> None:
        compare.key, compare.range_end = self.start.encode(), self.end
        compare.result, compare.target = etcdrpc.Compare.EQUAL, etcdrpc.Compare.VERSION
        compare.version = 0


@dataclass(frozen=True)
class Never(_Condition):
    """A condition that never holds (`key`'s version below 0): etcd still checks that
    the caller may read and write `key` (its auth checks both branches)."""

    key: str

    def fill(self, compare: etcdrpc.Compare) -> None:
        compare.key, compare.result = self.key.encode(), etcdrpc.Compare.LESS
        compare.target, compare.version = etcdrpc.Compare.VERSION, 0


Guard = ValueIs | CreatedAt | QuietSince | Unchanged | Empty | Never


class _Operation:
    """Each operation fills a `RequestOp` in place (`into`): building a transaction's
    messages in place instead of copying them in costs half as much."""

    def into(self, op: etcdrpc.RequestOp) -> None:
        raise NotImplementedError

    def request(self) -> etcdrpc.RequestOp:
        op = etcdrpc.RequestOp()
        self.into(op)
        return op


@dataclass(frozen=True)
class Put(_Operation):
    key: str
    value: bytes | str
    lease: int = 0

    def into(self, op: etcdrpc.RequestOp) -> None:
        put = op.request_put
        put.SetInParent()  # a put of empty values is still a put
        put.key, put.value, put.lease = self.key.encode(), to_bytes(self.value), self.lease


@dataclass(frozen=True)
class Delete(_Operation):
    key: str

    def into(self, op: etcdrpc.RequestOp) -> None:
        op.request_delete_range.SetInParent()
        op.request_delete_range.key = self.key.encode()


@dataclass(frozen=True)
class First(_Operation):
    """The lowest key in `[start, end)`."""

    start: str
    end: bytes

    def into(self, op: etcdrpc.RequestOp) -> None:
        first = op.request_range
        first.SetInParent()
        first.key, first.range_end, first.limit = self.start.encode(), self.end, 1


@dataclass(frozen=True)
class Get(_Operation):
    key: str

    def into(self, op: etcdrpc.RequestOp) -> None:
        op.request_range.SetInParent()
        op.request_range.key = self.key.encode()


@dataclass(frozen=True)
class Count(_Operation):
    """How many keys are under `prefix`."""

    prefix: str

    def into(self, op: etcdrpc.RequestOp) -> None:
        count = op.request_range
        count.SetInParent()
        count.key, count.range_end = self.prefix.encode(), prefix_end(self.prefix)
        count.count_only = True


@dataclass(frozen=True)
class When(_Operation):
    """A nested transaction: `ops` run only if every condition holds.

    Values compare as bytes, so fixed-width numbers compare as numbers; a
    missing key fails its condition. Conditions are checked against the store
    as it was before the enclosing transaction, atomically with it.
    """

    conditions: tuple[Guard, ...]
    ops: tuple[Put | Delete, ...]

    def into(self, op: etcdrpc.RequestOp) -> None:
        nested = op.request_txn
        nested.SetInParent()
        for condition in self.conditions:
            condition.fill(nested.compare.add())
        for inner in self.ops:
            inner.into(nested.success.add())


TxnOp = Put | Delete | First | Get | Count | When
