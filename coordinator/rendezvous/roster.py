"""The roster: who is in the job, at which address, written once by the leader.

It also carries the round's secret, with which members prove to each other that
they are the job's (`handshake`). The secret is stored with the roster in etcd
(`packed`; `to_etcd` is the same as plain JSON), under the job's keys, and
nowhere else: `model_dump` and `model_dump_json`, which the worker's events and
any printout use, leave it out, and so does the repr.

Every member reads the whole roster, so its size is paid N times. In etcd it is
packed (`packed`): one column per field, as JSON, zlib-compressed, behind a magic
prefix. Addresses, ports and host names repeat or share prefixes, so a member
costs about 15-30 bytes instead of about 130 as plain JSON. A packed roster is
read as untrusted input (`from_etcd`): its decompressed size is bounded, every
column must hold one entry per rank, and every entry is validated as in plain
JSON, which is still read.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from pydantic import BaseModel, Field, model_validator

from coordinator.rendezvous.handshake import SECRET_BYTES, HandshakeKey, key_for

#: The largest job the rendezvous supports. Its packed roster must fit one etcd
#: request (1.5 MiB by default), with room to spare: see `ROSTER_LIMIT_BYTES`.
MAX_WORLD_SIZE = 10_000

#: The largest packed roster a leader writes: below etcd's 1.5 MiB request limit.
ROSTER_LIMIT_BYTES = 1_000_000

#: The largest roster a reader decompresses (a bound on hostile input): the longest
#: fields of MAX_WORLD_SIZE members, with room to spare.
MAX_UNPACKED_BYTES = 16 << 20

PACKED_MAGIC = b"CRP1"
_COLUMNS = ("member_id", "host", "port", "hostname", "pid")


class RosterFormatError(ValueError):
    """A roster value in etcd that is not a roster: says which part is wrong, never the value."""


def check_world_size(world_size: int) -> int:
    """`world_size` if the rendezvous supports it; else a ValueError naming the limit."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(
            f"world_size {world_size} is above the largest supported, {MAX_WORLD_SIZE} "
            "(every member reads the whole roster, which must fit one etcd request)"
        )
    return world_size


class MemberAddress(BaseModel):
    rank: int = Field(ge=0)
    member_id: str = Field(min_length=1, max_length=256)
    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=0, le=65535)
    hostname: str = Field(default="", max_length=255)
    pid: int = Field(default=0, ge=0)


class Roster(BaseModel):
    """Immutable once written; `round` fences every later key of the rendezvous."""

    job_id: str
    round: int = Field(description="create revision of the leader's rank key")
    world_size: int = Field(ge=1, le=MAX_WORLD_SIZE)
    members: list[MemberAddress]
    secret: str = Field(
        exclude=True,
        repr=False,
        pattern=f"^[0-9a-f]{{{2 * SECRET_BYTES}}}$",
        description="the round's handshake secret, hex; only in etcd (see the module)",
    )

    @model_validator(mode="after")
    def _ranks_in_order(self) -> Roster:
        if [m.rank for m in self.members] != list(range(self.world_size)):
            raise ValueError(f"a roster lists ranks 0..{self.world_size - 1} in order, once each")
        return self

    @property
    def leader(self) -> MemberAddress:
        return self.members[0]

    def key_for(self, member: MemberAddress) -> HandshakeKey:
        """The handshake key of connections to `member`'s endpoint in this round."""
        return key_for(bytes.fromhex(self.secret), self.job_id, self.round, member.member_id)

    @property
    def secret_bytes(self) -> bytes:
        return bytes.fromhex(self.secret)

    def to_etcd(self) -> str:
        """The roster as plain JSON with the secret (read too; `packed` is what is written)."""
        return json.dumps({**self.model_dump(mode="json"), "secret": self.secret})

    def packed(self) -> bytes:
        """The roster's value in etcd, compact (see the module); it includes the secret."""
        columns: dict[str, Any] = {
            name: [getattr(m, name) for m in self.members] for name in _COLUMNS
        }
        document = {
            "job_id": self.job_id,
            "round": self.round,
            "world_size": self.world_size,
            "secret": self.secret,
            **columns,
        }
        text = json.dumps(document, separators=(",", ":")).encode()
        return PACKED_MAGIC + zlib.compress(text, 6)

    @classmethod
    def from_etcd(cls, value: bytes) -> Roster:
        """A roster read from etcd, packed or plain JSON, checked as untrusted input: a
        ValidationError names the bad field, a RosterFormatError the bad structure."""
        if not value.startswith(PACKED_MAGIC):
            return cls.model_validate_json(value)
        document = _unpack(value[len(PACKED_MAGIC) :])
        world_size = document.get("world_size")
        if not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD_SIZE:
            raise RosterFormatError(f"world_size is not a number in 1..{MAX_WORLD_SIZE}")
        for name in _COLUMNS:
            column = document.get(name)
            if not isinstance(column, list) or len(column) != world_size:
                raise RosterFormatError(f"column {name!r} does not list {world_size} entries")
        members = [
            {"rank": rank, **{name: document[name][rank] for name in _COLUMNS}}
            for rank in range(world_size)
        ]
        plain = {k: document.get(k) for k in ("job_id", "round", "world_size", "secret")}
        return cls.model_validate({**plain, "members": members})


def _unpack(compressed: bytes) -> dict[str, Any]:
    """The packed roster's JSON object, decompressed to at most MAX_UNPACKED_BYTES."""
    inflater = zlib.decompressobj()
    try:
        text = inflater.decompress(compressed, MAX_UNPACKED_BYTES)
    except zlib.error:
        raise RosterFormatError("its packed value is not zlib data") from None
    if inflater.unconsumed_tail:
        raise RosterFormatError(f"it unpacks to more than {MAX_UNPACKED_BYTES} bytes")
    if not inflater.eof:
        raise RosterFormatError("its packed value is cut short")
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        raise RosterFormatError("its unpacked value is not JSON") from None
    if not isinstance(document, dict):
        raise RosterFormatError("its unpacked value is not a JSON object")
    return document


# -- the roster file a member writes for its program (`jobs.environment.roster_document`) --


class MasterAddress(BaseModel):
    addr: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)


class RosterMember(BaseModel):
    rank: int = Field(ge=0)
    address: str = Field(min_length=1, max_length=255)
    endpoint_port: int = Field(ge=0, le=65535)
    hostname: str = ""
    pid: int = 0
    reserved_ports: list[int] = Field(default_factory=list, max_length=64)


class RosterFile(BaseModel):
    """The roster file a member writes for its program: no secret, and the ports it
    reserved for the program (rank 0's is MASTER_PORT)."""

    job_id: str
    round: int
    world_size: int = Field(ge=1)
    master: MasterAddress
    members: list[RosterMember]

    @model_validator(mode="after")
    def _ranks_in_order(self) -> RosterFile:
        if [m.rank for m in self.members] != list(range(self.world_size)):
            raise ValueError(f"members must list ranks 0..{self.world_size - 1} in order")
        return self
