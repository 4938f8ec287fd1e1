"""The roster: who is in the job, at which address, written once by the leader.

It also carries the round's secret, with which members prove to each other that
they are the job's (`handshake`). The secret is stored with the roster in etcd
(`to_etcd`), under the job's keys, and nowhere else: `model_dump` and
`model_dump_json`, which the worker's events and any printout use, leave it out,
and so does the repr.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, Field, model_validator

from coordinator.rendezvous.handshake import SECRET_BYTES, HandshakeKey, key_for


class MemberAddress(BaseModel):
    rank: int = Field(ge=0)
    member_id: str = Field(min_length=1, max_length=256)
    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=0, le=65535)
    hostname: str = ""
    pid: int = 0


class Roster(BaseModel):
    """Immutable once written; `round` fences every later key of the rendezvous."""

    job_id: str
    round: int = Field(description="create revision of the leader's rank key")
    world_size: int = Field(ge=1)
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

    def address_of(self, rank: int) -> str:
        member = self.members[rank]
        return f"{member.host}:{member.port}"

    def key_for(self, member: MemberAddress) -> HandshakeKey:
        """The handshake key of connections to `member`'s endpoint in this round."""
        return key_for(bytes.fromhex(self.secret), self.job_id, self.round, member.member_id)

    @property
    def secret_bytes(self) -> bytes:
        return bytes.fromhex(self.secret)

    def to_etcd(self) -> str:
        """The roster's value in etcd: the only serialisation that includes the secret."""
        return json.dumps({**self.model_dump(mode="json"), "secret": self.secret})

    @classmethod
    def from_etcd(cls, value: bytes) -> Roster:
        """A roster read from etcd, checked (a ValidationError names the bad field)."""
        return cls.model_validate_json(value)


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
