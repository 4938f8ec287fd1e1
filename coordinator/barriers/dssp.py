"""DSSP's synchronisation controller, pure (Zhao et al., Dynamic Stale Synchronous Parallel).

A worker runs under SSP(S_L). When the *fastest* worker reaches the S_L gap,
instead of waiting at once it may get `r` extra steps, 0 <= r <= S_U - S_L,
chosen from predicted push times: keep running exactly as long as it can
finish steps before the slowest worker's next predicted push, so that its
waiting (idle) time is smallest.

A literal reading of the algorithm lets staleness grow without bound (a
worker could be granted credit again and again while the slowest falls
further behind). Here credit is granted **once per episode**: an episode
starts when the worker first crosses S_L and ends when the gap is back within
S_L. Hence the gap never exceeds S_U + 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Pushes:
    """What the controller knows of one worker: its clock, last push time, recent interval."""

    clock: int
    last_push: float
    interval: float  # mean of its recent step intervals (seconds)


def slowest_of(workers: Mapping[int, Pushes]) -> int:
    """The worker DSSP predicts from: the lowest clock; among several there, the one whose
    next push is predicted latest (last push + interval), since the others wait for it;
    the lowest rank on a tie. Live workers and the simulator both choose by this rule."""
    return min(workers, key=lambda r: (workers[r].clock, -_next_push(workers[r]), r))


def _next_push(worker: Pushes) -> float:
    return worker.last_push + worker.interval


def extra_steps(fastest: Pushes, slowest: Pushes, now: float, s_low: int, s_high: int) -> int:
    """How many steps beyond S_L the fastest may run before it checks again.

    The largest r <= S_U - S_L whose r-th step ends no later than the slowest
    worker's next predicted push: waiting after that is shortest. 0 when the
    slowest's push is already due, or when the fastest's steps are unknown (no
    interval yet).
    """
    room = s_high - s_low
    if room <= 0 or fastest.interval <= 0:
        return 0
    slowest_next = _next_push(slowest)
    if slowest_next <= now:
        return 0
    # min before int(): a tiny interval makes the quotient inf, which int() rejects
    return int(min(room, (slowest_next - now) // fastest.interval))


@dataclass
class Credit:
    """One worker's extra-step credit and whether its current episode already had some."""

    remaining: int = 0
    granted_this_episode: bool = False


def decide(
    clock: int,
    slowest_clock: int,
    is_fastest: bool,
    credit: Credit,
    grant: int,
    s_low: int,
) -> bool:
    """May a worker with `clock` start its next step? Updates `credit` in place.

    `grant` is `extra_steps(...)`, computed by the caller only when it can
    matter (the worker is the fastest and past S_L). Follows the seed's server
    logic: spend credit first; else pass within S_L; else the fastest may get
    credit once per episode; else wait for the slowest.
    """
    gap = clock - slowest_clock
    if gap <= s_low:
        credit.granted_this_episode = False  # back within S_L: the episode is over
        credit.remaining = 0
        return True
    if credit.remaining > 0:
        credit.remaining -= 1
        return True
    if is_fastest and not credit.granted_this_episode:
        credit.granted_this_episode = True
        if grant > 0:
            credit.remaining = grant - 1
            return True
    return False
