"""One simulated epoch per method against one plain epoch of the same training.

The simulator computes every gradient for real, so a simulated epoch should cost
about one epoch of single-process training whatever P (the goal: at most 1.5x).
This measures both in the same process, one torch thread each: a plain epoch
(`torch.optim.SGD` over the whole training set, batch `--batch`), then one
simulated epoch at P = `--workers` under each method (evaluations only at the
start and the end, on the first `--test-rows` test images), and prints each
simulated epoch's wall time over the plain epoch's.

    python bench/sim_epoch.py                                  # Fashion-MNIST, P=64
    python bench/sim_epoch.py --data digits --workers 8        # a quick look
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.nn import functional

from coordinator.barriers.arguments import barrier_list
from coordinator.datasets.mnist import parse_mnist
from coordinator.ps.optim import OptimizerSpec
from coordinator.simulator.training import initial_weights, train
from coordinator.simulator.training_data import TrainingData

FASHION = "/usr/share/datasets/fashion-mnist"
METHODS = "bsp,ssp:3,asp,pbsp:4,pssp:3:4,dssp:3:12"
console = Console()


def plain_epoch(data: TrainingData, batch: int, optimizer: OptimizerSpec, seed: int) -> float:
    """Seconds of one epoch of ordinary training over every shard's rows, shuffled."""
    x = torch.cat([shard_x for shard_x, _ in data.shards])
    y = torch.cat([shard_y for _, shard_y in data.shards])
    model = initial_weights(seed, data.rows, data.cols)
    sgd = torch.optim.SGD(model.parameters(), lr=optimizer.lr, momentum=optimizer.momentum)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    began = time.perf_counter()
    for low in range(0, len(y), batch):
        rows = order[low : low + batch]
        sgd.zero_grad()
        functional.cross_entropy(model(x[rows]), y[rows]).backward()
        sgd.step()
    return time.perf_counter() - began


def main(
    data: Annotated[str, typer.Option(help="digits, or a directory of MNIST IDX files")] = FASHION,
    workers: Annotated[int, typer.Option(min=1, help="virtual trainers P")] = 64,
    batch: Annotated[int, typer.Option(min=1)] = 32,
    methods: Annotated[str, typer.Option(help="comma-separated barrier specs")] = METHODS,
    test_rows: Annotated[int, typer.Option(min=1)] = 10_000,
    seed: int = 0,
) -> None:
    specs = barrier_list(methods)
    optimizer = OptimizerSpec("sgd", 0.02, momentum=0.9)
    began = time.perf_counter()
    shards = TrainingData.load(parse_mnist(data), workers, test_rows=test_rows)
    console.print(f"loaded {shards.train_count} rows in {workers} shards "
                  f"in {time.perf_counter() - began:.1f} s")  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the simulator
    try:
        plain = plain_epoch(shards, batch, optimizer, seed)
    finally:
        torch.set_num_threads(threads)
    table = Table(title=f"one epoch, P={workers}, batch {batch}: wall seconds and over plain")
    for column in ("run", "wall s", "x plain", "updates", "virtual s", "final accuracy"):
        table.add_column(column, justify="left" if column == "run" else "right")
    table.add_row("plain epoch (torch.optim.SGD)", f"{plain:.1f}", "1.00", "", "", "")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("simulated epochs", total=len(specs))
        for spec in specs:
            progress.update(task, description=f"simulating {spec}")
            began = time.perf_counter()
            run = train(spec, shards, batch_size=batch, epochs=1, seed=seed,
                        optimizer=optimizer, eval_updates=10**9)  # fmt: skip
            wall = time.perf_counter() - began
            table.add_row(f"simulated {run.label}", f"{wall:.1f}", f"{wall / plain:.2f}",
                          str(run.updates), f"{run.virtual_seconds:.1f}",
                          f"{run.evaluations[-1].accuracy:.3f}")  # fmt: skip
            progress.advance(task)
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
