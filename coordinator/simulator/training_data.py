"""What a training simulation trains and scores on: every virtual trainer's shard and the
test set, as tensors, cut as the live `mnist` job cuts them (load once, train many runs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coordinator.datasets.mnist import MnistSource, load_test, load_train_shard
from coordinator.datasets.shards import plan


@dataclass
class TrainingData:
    """Every trainer's shard and the test set, as tensors (load once, train many runs)."""

    shards: list[tuple[torch.Tensor, torch.Tensor]]
    test: tuple[torch.Tensor, torch.Tensor]
    rows: int
    cols: int

    @classmethod
    def load(cls, source: MnistSource, workers: int, test_rows: int | None = None) -> TrainingData:
        """`workers` shards as the live job cuts them; the test set (its first `test_rows`)."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        shards = []
        for w in range(workers):
            images = load_train_shard(source, w, workers)
            shards.append((torch.from_numpy(images.x), torch.from_numpy(images.y)))
        test = load_test(source)
        x, y = torch.from_numpy(test.x), torch.from_numpy(test.y)
        if test_rows is not None:
            x, y = x[:test_rows], y[:test_rows]
        return cls(shards, (x, y), source.rows, source.cols)

    @classmethod
    def from_tensors(
        cls,
        x: torch.Tensor,
        y: torch.Tensor,
        test_x: torch.Tensor,
        test_y: torch.Tensor,
        workers: int,
    ) -> TrainingData:
        """A user's data: `workers` shards of contiguous rows, cut as the live job cuts one
        file (`shards.plan`); `y` and `test_y` are integer class labels."""
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if len(x) != len(y) or len(test_x) != len(test_y):
            raise ValueError("x and y (and test_x and test_y) must have as many rows")
        if len(x) < workers:
            raise ValueError(f"{len(x)} training rows cannot make {workers} shards")
        if y.dtype.is_floating_point or test_y.dtype.is_floating_point:
            raise ValueError("y and test_y must be integer class labels")
        shards = []
        for pieces in plan([len(x)], workers):
            rows = torch.cat([torch.arange(piece.start, piece.stop) for piece in pieces])
            shards.append((x[rows], y[rows]))
        return cls(shards, (test_x, test_y), 0, 0)

    @property
    def workers(self) -> int:
        return len(self.shards)

    @property
    def train_count(self) -> int:
        return sum(len(y) for _, y in self.shards)
