"""What the `mnist` job reads off its `Member`: its rank, where the servers are, who was lost."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from coordinator.ps import api as ps

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member


class LostMembers:
    """The members etcd reported lost, in the order it reported them: a trainer names the
    cause of a broken connection by them, a server fails or goes on without them."""

    def __init__(self) -> None:
        self.reasons: dict[int, str] = {}  # rank -> reason
        self.reported = threading.Event()  # set at each report; a waiter clears it

    def record(self, rank: int, reason: str) -> None:
        self.reasons.setdefault(rank, reason)
        self.reported.set()


def member_rank(member: Member) -> int:
    if member.rank is None:
        raise RuntimeError("the member has not joined the job")
    return member.rank


def server_peers(member: Member, servers: int) -> ps.Peers:
    """The servers are the first `servers` members, at their roster endpoints."""
    if member.roster is None:
        raise RuntimeError("the member holds no roster")
    addresses = [
        ps.ServerAddress(m.rank, m.host, m.port, m.member_id)
        for m in member.roster.members[:servers]
    ]
    return ps.Peers(member.job_id, member.round, addresses, member.roster.secret_bytes)
