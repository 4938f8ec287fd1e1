"""What a live step barrier publishes, returns and counts, and how it orders clocks in etcd."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from coordinator.keys import LEVEL_DIGITS

DONE = 10**12 - 1  # the clock of a finished worker (its order level, its `at` value): above all


@dataclass(frozen=True)
class Clock:
    """One worker's published state."""

    clock: int
    t: float = 0.0
    interval: float = 0.0
    done: bool = False

    @classmethod
    def parse(cls, value: bytes) -> Clock:
        data = json.loads(value)
        return cls(int(data["clock"]), data["t"], data["interval"], bool(data["done"]))

    def dump(self) -> str:
        return json.dumps(
            {"clock": self.clock, "t": self.t, "interval": self.interval, "done": self.done}
        )


@dataclass(frozen=True)
class Passage:
    """What a worker saw when it passed the barrier before step `clock + 1`."""

    clock: int
    slowest: int | None  # the slowest clock the decision relied on (BSP/SSP: job-wide, self too)
    # rank -> clock, the unfinished peers read (PSP sample, DSSP view); PSP passes a peer
    # that a wake-up vouched for, but not read since, as `clock - s` (it is at least there)
    observed: dict[int, int]
    waited: float  # seconds spent waiting


@dataclass
class Counters:
    checks: int = 0
    reads: int = 0
    waits: int = 0
    lost: list[int] = field(default_factory=list)


def fixed(clock: int) -> str:
    """A clock as a fixed-width string: etcd compares values as bytes."""
    return f"{clock:0{LEVEL_DIGITS}d}"
