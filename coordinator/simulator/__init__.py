"""A seeded discrete-event simulator of step barriers over the shared decision code.

`coordinator.barriers.policy` and `coordinator.barriers.dssp` decide; this
package only supplies virtual workers, step durations and bookkeeping.
"""

from coordinator.simulator.delays import DelayModel, parse_delay
from coordinator.simulator.engine import Result, simulate

__all__ = ["DelayModel", "Result", "parse_delay", "simulate"]
