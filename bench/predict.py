"""The simulator's prediction of live runs: total training time and time to accuracy.

For each method and seed, a live `mnist` job (1 server, `--trainers` trainers,
real processes, embedded etcd) trains and records every trainer's step
durations (`step_times.csv`: from the barrier letting a step start to the
trainer's next barrier call; barrier waits left out) and its evaluation curve
(server 0, every `--eval-seconds` of wall time, or back to back when an
evaluation takes longer). The simulator then trains the same model on the same
shards with the same optimizer (the job's own `parse`), replaying those
durations as its delay model (`trace:`, no transfer added: the trace holds it),
under the same barrier decisions, and predicts:

- the whole run's training time (error = predicted / live - 1);
- the time to `--target` accuracy. The live time is only known to lie between
  the last evaluation below the target and the first at or above it; the error
  is the prediction's distance outside that interval, over the live time (0 when
  the prediction falls inside it).

    python bench/predict.py                               # bsp, ssp, asp; 1 seed
    python bench/predict.py --seeds 3 --straggler         # the last trainer 3x slower
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from methods import METHODS, Run, run_one  # bench/methods.py

from coordinator.etcd.server import EmbeddedEtcd
from coordinator.jobs.mnist import parse
from coordinator.simulator.delays import Trace
from coordinator.simulator.training import TrainingData, TrainingRun, Transfer, train

console = Console(width=120)
NO_TRANSFER = Transfer(latency=0.0, bandwidth=1e18)  # the trace's durations include it


def simulate_live(params: dict[str, str], world_size: int, trace: Path) -> TrainingRun:
    """The simulator's run of the job `params` describes, on the live run's `trace`."""
    options = parse(params, world_size)
    data = TrainingData.load(options.data, options.trainers)
    return train(
        options.spec,
        data,
        batch_size=options.batch_size,
        epochs=options.epochs,
        delay=Trace(trace),
        seed=options.seed,
        optimizer=options.optimizer,
        aggregate=options.aggregate,
        eval_seconds=0.05,
        transfer=NO_TRANSFER,
    )


def live_interval(metrics: list[dict[str, Any]], target: float) -> tuple[float, float] | None:
    """When the live run reached `target`: after the last evaluation below it, by the first
    at or above it."""
    before = 0.0
    for record in metrics:
        if record["accuracy"] >= target:
            return before, float(record["t"])
        before = float(record["t"])
    return None


def outside(value: float, interval: tuple[float, float]) -> float:
    """How far `value` lies outside `interval`, over the interval's end (0 inside)."""
    low, high = interval
    return (min(value - low, 0.0) + max(value - high, 0.0)) / high


def main(
    methods: Annotated[str, typer.Option(help="comma-separated, of bench/methods.py's")] = (
        "bsp,ssp,asp"
    ),
    seeds: Annotated[int, typer.Option(min=1, help="live runs per method (seeds 0..K-1)")] = 1,
    trainers: Annotated[int, typer.Option(min=1)] = 2,
    epochs: Annotated[int, typer.Option(min=1)] = 5,
    target: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.95,
    eval_seconds: Annotated[float, typer.Option(min=0.05)] = 0.1,
    straggler: Annotated[bool, typer.Option(help="the last trainer 3x slower")] = False,
) -> None:
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        raise typer.BadParameter(f"unknown: {', '.join(unknown)}", param_hint="--methods")
    world_size = trainers + 1
    title = f"live vs simulated from the live trace (time to {target:g}: live interval)"
    table = Table(title=title)
    for column in ("method", "seed", "live s", "predicted s", "error", f"live to {target:g}",
                   "predicted", "error "):  # fmt: skip
        table.add_column(column, justify="left" if column == "method" else "right")
    errors: dict[str, list[tuple[float, float]]] = {m: [] for m in chosen}
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with (
        tempfile.TemporaryDirectory() as scratch,
        EmbeddedEtcd() as etcd,
        Progress(*columns, console=console, transient=True) as progress,
    ):
        etcd.security.export()  # members log in as root (auth is on)
        for method in chosen:
            for seed in range(seeds):
                artifacts = Path(scratch) / "artifacts"
                params = {
                    **METHODS[method], "epochs": str(epochs), "seed": str(seed),
                    "eval_seconds": str(eval_seconds), "artifacts": str(artifacts),
                }  # fmt: skip
                if straggler:
                    params |= {"straggler_rank": str(world_size - 1), "straggler_factor": "3"}
                task = progress.add_task(f"{method} seed {seed}: live", total=None)
                summary = run_one(
                    etcd.endpoint, artifacts, Run(method, straggler), params, world_size,
                    progress, task,
                )  # fmt: skip
                progress.update(task, description=f"{method} seed {seed}: simulated")
                run = simulate_live(params, world_size, Path(summary["step_times_path"]))
                progress.remove_task(task)
                total_error = run.virtual_seconds / summary["seconds"] - 1
                interval = live_interval(summary["metrics"], target)
                predicted = run.time_to(target)
                reach_error = (
                    outside(predicted, interval) if interval and predicted is not None else None
                )
                if reach_error is not None:
                    errors[method].append((total_error, reach_error))
                table.add_row(
                    method, str(seed), f"{summary['seconds']:.2f}", f"{run.virtual_seconds:.2f}",
                    f"{total_error:+.0%}",
                    "never" if interval is None else f"{interval[0]:.2f}-{interval[1]:.2f}",
                    "never" if predicted is None else f"{predicted:.2f}",
                    "" if reach_error is None else f"{reach_error:+.0%}",
                )  # fmt: skip
    console.print(table)
    for method, values in errors.items():
        if values:
            total = statistics.fmean(abs(t) for t, _ in values)
            reach = statistics.fmean(abs(r) for _, r in values)
            console.print(f"{method}: mean |error| {total:.0%} (total time), {reach:.0%} "
                          f"(time to {target:g}) over {len(values)} run(s)")  # fmt: skip


if __name__ == "__main__":
    typer.run(main)
