"""The `noop` job: rendezvous through every phase and train nothing.

It proves a deployment's plumbing (etcd reachable, addresses right, every
member reachable by the leader) before real training is put on it. With the
parameter `seconds` it holds that long between `connect` and `training`, as a
stand-in for training time, to try out what happens when a member dies then.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from coordinator.jobs.params import check_known, float_param

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member


def check(params: dict[str, str]) -> float:
    check_known("noop", params, ["seconds"])
    return float_param("noop", params, "seconds", 0.0)


def run(member: Member, seconds: float) -> dict[str, object]:
    time.sleep(seconds)  # the stand-in for training itself
    return {"seconds": seconds}
