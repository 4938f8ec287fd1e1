"""The `noop` job: rendezvous through every phase and train nothing.

It proves a deployment's plumbing (etcd reachable, addresses right, every
member reachable by the leader) before real training is put on it. With the
parameter `seconds` it holds that long between `connect` and `training`, as a
stand-in for training time, to try out what happens when a member dies then.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member


def run(member: Member, params: dict[str, str]) -> dict[str, object]:
    unknown = set(params) - {"seconds"}
    if unknown:
        raise ValueError(
            f"noop job: unknown parameter(s) {', '.join(sorted(unknown))} (known: seconds)"
        )
    try:
        seconds = float(params.get("seconds", "0"))
    except ValueError:
        raise ValueError(
            f"noop job: parameter seconds={params['seconds']!r} is not a number"
        ) from None
    time.sleep(seconds)  # the stand-in for training itself
    return {"seconds": seconds}
