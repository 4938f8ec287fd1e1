"""The step barrier on etcd: each worker's clock is a key bound to its lease.

`LiveBarrier(member, spec, ...)` runs `spec.method`, one module each, over a
shared base:

- `base`: the start barrier, the inbox that watches feed, loss handling,
  publishing the clock (`clocks/<rank>`), stop.
- `records`: what is published and returned (`Clock`, `Passage`), `OnLoss`.
- `ordered`: BSP and SSP, which need only the job's slowest clock (order keys
  and one watch on `slowest`).
- `full_view`: DSSP, which needs every clock (one watch keeps a local view) and
  stores its credit.
- `sampled`: pBSP and pSSP, which read a sample of beta peers with each publish
  and are woken by mail from the last of them (`sample_stream`: the generator
  every member draws the samples with).
- `asp`: ASP, which never waits and publishes only to show progress.

Decisions are `policy.may_start` and `dssp.decide`, pure and shared with the
simulator; a method reads, decides, then writes, and waits with watches, never
by polling.
"""

from coordinator.barriers.live.asp import ASP_PUBLISH_SECONDS, AspBarrier
from coordinator.barriers.live.base import LiveBarrier
from coordinator.barriers.live.full_view import FullViewBarrier
from coordinator.barriers.live.ordered import OrderedBarrier
from coordinator.barriers.live.records import DONE, Clock, Counters, Passage
from coordinator.barriers.live.sampled import MAX_TXN_OPS, SampledBarrier
from coordinator.barriers.policy import OnLoss

__all__ = [
    "ASP_PUBLISH_SECONDS",
    "DONE",
    "MAX_TXN_OPS",
    "AspBarrier",
    "Clock",
    "Counters",
    "FullViewBarrier",
    "LiveBarrier",
    "OnLoss",
    "OrderedBarrier",
    "Passage",
    "SampledBarrier",
]
