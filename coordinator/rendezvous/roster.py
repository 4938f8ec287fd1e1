"""The roster: who is in the job, at which address, written once by the leader."""

from __future__ import annotations

from pydantic import BaseModel, Field


class MemberAddress(BaseModel):
    rank: int = Field(ge=0)
    member_id: str
    host: str
    port: int = Field(ge=0, le=65535)
    hostname: str = ""
    pid: int = 0


class Roster(BaseModel):
    """Immutable once written; `round` fences every later key of the rendezvous."""

    job_id: str
    round: int = Field(description="create revision of the leader's rank key")
    world_size: int = Field(ge=1)
    members: list[MemberAddress]

    @property
    def leader(self) -> MemberAddress:
        return self.members[0]

    def address_of(self, rank: int) -> str:
        member = self.members[rank]
        return f"{member.host}:{member.port}"
