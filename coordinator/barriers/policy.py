"""Per-step barrier decisions: pure functions of the step clocks a worker sees.

The live etcd barrier and the simulator both call these, so a method behaves
the same in a real job and at simulated scale.

Conventions (each a deliberate choice; public implementations differ):

- A worker's **clock** is the number of steps it has *completed* (0 at start).
  A worker with clock `c` asks before starting step `c + 1`.
- It may start when every clock it observes is **>= c - s** (non-strict), with
  `s` the staleness: BSP is s = 0 (everyone has completed `c`), SSP(s) lets the
  slowest lag `s` steps, ASP never waits. So the gap between the fastest and
  the slowest clock never exceeds `s + 1`.
- **PSP** (pBSP: s = 0, pSSP: s > 0) applies the same test to `beta` peers
  drawn uniformly without replacement from the *other* workers. beta = 0
  observes nobody (ASP); beta >= P - 1 observes everyone (SSP/BSP) and draws
  no random numbers, so a seeded run reproduces SSP/BSP exactly.
- **When the sample is drawn** is the caller's choice (`SampleTiming`): the live
  barrier draws once per step and watches those beta keys for the whole wait;
  the simulator can also redraw at every check, as the PSP authors' simulator
  does.
- **DSSP** is SSP(S_L) plus extra credit for the fastest worker, chosen by
  `coordinator.barriers.dssp`; the gap never exceeds S_U + 1.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Method(StrEnum):
    BSP = "bsp"
    SSP = "ssp"
    ASP = "asp"
    PBSP = "pbsp"
    PSSP = "pssp"
    DSSP = "dssp"


class OnLoss(StrEnum):
    FAIL = "fail"  # a lost peer fails the job at once, naming it
    CONTINUE = "continue"  # a lost peer leaves the barrier set; the rest carry on


class SampleTiming(StrEnum):
    PER_STEP = "per-step"  # one sample for the whole wait (the live barrier)
    PER_CHECK = "per-check"  # a fresh sample at every re-check (the PSP authors' simulator)


@dataclass(frozen=True)
class BarrierSpec:
    """A method with its parameters; `validate()` names a bad field."""

    method: Method
    staleness: int = 0  # SSP and pSSP: s; DSSP: the lower bound S_L
    sample: int = 0  # pBSP and pSSP: beta
    staleness_upper: int = 0  # DSSP: the upper bound S_U

    def validate(self) -> BarrierSpec:
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.sample < 0:
            raise ValueError(f"sample (beta) must be >= 0, got {self.sample}")
        if self.method in (Method.BSP, Method.PBSP, Method.ASP) and self.staleness:
            raise ValueError(f"{self.method} takes no staleness (got {self.staleness})")
        if self.method in (Method.SSP, Method.PSSP) and self.staleness < 1:
            raise ValueError(f"{self.method} needs staleness >= 1 (got {self.staleness})")
        if self.method not in (Method.PBSP, Method.PSSP) and self.sample:
            raise ValueError(f"{self.method} takes no sample (got {self.sample})")
        if self.method == Method.DSSP and self.staleness_upper < self.staleness:
            raise ValueError(
                f"dssp needs staleness_upper (S_U={self.staleness_upper}) >= "
                f"staleness (S_L={self.staleness})"
            )
        if self.method != Method.DSSP and self.staleness_upper:
            raise ValueError(f"{self.method} takes no staleness_upper")
        return self

    @property
    def bound(self) -> int | None:
        """The staleness the clock test uses; None means never wait (ASP)."""
        if self.method == Method.ASP:
            return None
        return self.staleness

    @property
    def sampled(self) -> bool:
        return self.method in (Method.PBSP, Method.PSSP)

    def __str__(self) -> str:
        parts = {
            Method.SSP: f"ssp(s={self.staleness})",
            Method.PBSP: f"pbsp(beta={self.sample})",
            Method.PSSP: f"pssp(s={self.staleness}, beta={self.sample})",
            Method.DSSP: f"dssp(S_L={self.staleness}, S_U={self.staleness_upper})",
        }
        return parts.get(self.method, self.method.value)


def may_start(clock: int, observed: Iterable[int], bound: int | None) -> bool:
    """May a worker that completed `clock` steps start the next one, seeing `observed`?"""
    if bound is None:
        return True
    floor = clock - bound
    return all(other >= floor for other in observed)


def draw_sample(rng: random.Random, peers: Sequence[int], beta: int) -> list[int]:
    """`beta` of `peers` without replacement; all of them, drawing nothing, when beta >= len."""
    if beta >= len(peers):
        return list(peers)
    if beta <= 0:
        return []
    return rng.sample(peers, beta)
