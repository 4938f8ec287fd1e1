"""What a training simulation returns: its evaluations over virtual time, the staleness of
every gradient, the final weights, and where it stopped."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from coordinator.barriers.policy import BarrierSpec, SampleTiming


@dataclass(frozen=True)
class Evaluation:
    virtual_seconds: float
    updates: int
    samples: int  # training samples in the updates applied so far
    accuracy: float
    loss: float


@dataclass
class TrainingRun:
    """One method, one seed: the evaluations, the staleness of every gradient, the end."""

    label: str
    seed: int
    evaluations: list[Evaluation]
    staleness: Counter[int]
    weights: torch.Tensor  # the server's final flat weights (FlatModel order, one server)
    updates: int
    samples: int
    virtual_seconds: float  # when it stopped

    def time_to(self, target: float) -> float | None:
        """Virtual seconds of the first evaluation at or above `target`; None if never."""
        for evaluation in self.evaluations:
            if evaluation.accuracy >= target:
                return evaluation.virtual_seconds
        return None


def label(spec: BarrierSpec, aggregate: bool = False, timing: SampleTiming | None = None) -> str:
    if aggregate:
        return f"{spec}-agg"
    if spec.sampled and timing == SampleTiming.PER_STEP:
        return f"{spec} per-step"
    return str(spec)
