"""The `noop` job: rendezvous through every phase and train nothing.

It proves a deployment's plumbing (etcd reachable, addresses right, every
member reachable by the leader) before real training is put on it. With the
parameter `seconds` it holds that long between `connect` and `training`, as a
stand-in for training time, to try out what happens when a member dies then:
the others stop at once (within the lease TTL), not at the next barrier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coordinator.jobs.catalog import NOOP, maximum, names
from coordinator.jobs.params import check_known, float_param

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member


def check(params: dict[str, str]) -> float:
    check_known("noop", params, names(NOOP))
    return float_param("noop", params, "seconds", 0.0, maximum(NOOP, "seconds"))


def run(member: Member, seconds: float) -> dict[str, object]:
    # The stand-in for training: it ends at once when a member is lost meanwhile.
    lost = member.wait_for_loss(seconds)
    if lost is not None:
        raise lost
    return {"seconds": seconds}
