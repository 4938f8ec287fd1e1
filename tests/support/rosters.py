"""A roster like one real members make, at any size: for the tests of the roster's size
and parsing, and for bench/rendezvous.py's table of its size in etcd."""

from __future__ import annotations

import secrets

from coordinator.rendezvous.roster import MemberAddress, Roster


def synthetic_roster(n: int, hosts: int = 64, secret: str = "00" * 32) -> Roster:
    """`n` members spread over `hosts` hosts, with default member ids (host-pid-random)
    and ports the kernel might have chosen."""
    members = []
    for rank in range(n):
        host = rank % hosts
        pid = 10_000 + rank * 7 % 50_000
        members.append(
            MemberAddress(
                rank=rank,
                member_id=f"node-{host:03d}-{pid}-{secrets.token_hex(4)}",
                host=f"10.0.{host // 250}.{host % 250 + 1}",
                port=30_000 + secrets.randbelow(30_000),
                hostname=f"node-{host:03d}",
                pid=pid,
            )
        )
    return Roster(job_id="synthetic", round=1, world_size=n, members=members, secret=secret)
