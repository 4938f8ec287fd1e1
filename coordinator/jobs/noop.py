"""The `noop` job: rendezvous through every phase and train nothing.

It proves a deployment's plumbing (etcd reachable, addresses right, every
member reachable by the leader) before real training is put on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member


def run(member: Member) -> dict[str, object]:
    return {}
