"""A parameter server's checkpoint file: its share of the weights, the optimizer's state,
its version and the trainers' clocks, from which a rerun of the job continues.

Written whole (a temporary name, then a rename), so a crash mid-save leaves the last good
file. Read back with `weights_only` (tensors and numbers, no code) and checked against
the server it is to restore: a file of another model or trainer count is refused, naming
it, rather than loaded into the wrong shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coordinator.files import replacing


@dataclass(frozen=True)
class Saved:
    """What a checkpoint holds."""

    version: int
    clocks: dict[int, int]  # trainer -> its completed steps when `version` was made
    params: torch.Tensor  # the flat share
    optimizer: dict[str, Any]
    layout: str  # the share's layout digest: which model and server it belongs to


@dataclass(frozen=True)
class Checkpoints:
    """Where a server keeps its checkpoint, how often it saves, and whether it resumes."""

    path: Path
    every: int = 0  # updates between saves (0: only when asked)
    resume: bool = False  # continue from the file when there is one

    def due(self, version: int) -> bool:
        return self.every > 0 and version % self.every == 0

    def save(self, saved: Saved) -> None:
        state = {
            "version": saved.version,
            "clocks": saved.clocks,
            "params": saved.params,
            "optimizer": saved.optimizer,
            "layout": saved.layout,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(self.path) as partial:
            torch.save(state, partial)

    def to_resume(self, layout: str, trainers: int, size: int) -> Saved | None:
        """The saved state to continue from (None: not resuming, or nothing saved yet)."""
        if not self.resume or not self.path.exists():
            return None
        try:
            state = torch.load(self.path, weights_only=True)
            saved = Saved(
                version=int(state["version"]),
                clocks={int(t): int(clock) for t, clock in state["clocks"].items()},
                params=state["params"],
                optimizer=state["optimizer"],
                layout=state["layout"],
            )
        except Exception as exc:  # a file torch cannot read, or without these fields
            raise ValueError(f"checkpoint {self.path} is unreadable: {exc}") from None
        if (
            saved.layout != layout
            or set(saved.clocks) != set(range(trainers))
            or not isinstance(saved.params, torch.Tensor)
            or saved.params.numel() != size
        ):
            raise ValueError(
                f"checkpoint {self.path} is of another model or trainer count "
                f"({len(saved.clocks)} trainers); remove it or use another job id"
            )
        return saved
