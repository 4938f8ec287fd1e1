"""The outputs of a training simulation: accuracy curves, time to accuracy, staleness.

CSV files always (`accuracy.csv`, `time_to_accuracy.csv`, `staleness.csv`); the
plots (`accuracy.png`, `time_to_accuracy.png`) need matplotlib, the `sim` extra,
and raise `report.PlotUnavailable` naming it when it is missing.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.simulator.report import SIM_EXTRA, PlotUnavailable

if TYPE_CHECKING:  # the runs come from the torch side; this module needs no torch
    from coordinator.simulator.training_results import TrainingRun

ACCURACY_COLUMNS = ["method", "seed", "virtual_seconds", "updates", "samples", "accuracy", "loss"]
TIME_COLUMNS = ["method", "target", "mean", "ci95_low", "ci95_high", "reached", "seeds"]
STALENESS_COLUMNS = ["method", "seed", "staleness", "count"]

#: Student's t, 0.975 quantile, for 1..30 degrees of freedom.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """The two-sided 95 % quantile of Student's t (beyond 30 df within 0.002 of it)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


def mean_interval(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean of `values` and the half width of its 95 % Student-t interval (None for a
    single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


@dataclass(frozen=True)
class TimeToAccuracy:
    method: str
    target: float
    mean: float | None  # over the seeds that reached it
    low: float | None  # t-interval, 95 %; None with fewer than 2 seeds reaching it
    high: float | None
    reached: int
    seeds: int


def methods(runs: Sequence[TrainingRun]) -> list[str]:
    """The methods in the order they ran."""
    return list(dict.fromkeys(run.label for run in runs))


def time_to_accuracy(runs: Sequence[TrainingRun], targets: Sequence[float]) -> list[TimeToAccuracy]:
    rows = []
    for method in methods(runs):
        mine = [run for run in runs if run.label == method]
        for target in targets:
            times = [t for t in (run.time_to(target) for run in mine) if t is not None]
            mean = low = high = None
            if times:
                mean, half = mean_interval(times)
                if half is not None:
                    low, high = mean - half, mean + half
            rows.append(TimeToAccuracy(method, target, mean, low, high, len(times), len(mine)))
    return rows


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.6f}"


def write_csvs(
    runs: Sequence[TrainingRun], targets: Sequence[float], directory: Path
) -> list[Path]:
    """accuracy.csv, time_to_accuracy.csv and staleness.csv in `directory`."""
    paths = [directory / name for name in ("accuracy.csv", "time_to_accuracy.csv", "staleness.csv")]
    with paths[0].open("w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(ACCURACY_COLUMNS)
        for run in runs:
            for e in run.evaluations:
                out.writerow(
                    [run.label, run.seed, f"{e.virtual_seconds:.6f}", e.updates, e.samples,
                     f"{e.accuracy:.6f}", f"{e.loss:.6f}"]
                )  # fmt: skip
    with paths[1].open("w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(TIME_COLUMNS)
        for row in time_to_accuracy(runs, targets):
            out.writerow(
                [row.method, f"{row.target:g}", _number(row.mean), _number(row.low),
                 _number(row.high), row.reached, row.seeds]
            )  # fmt: skip
    with paths[2].open("w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(STALENESS_COLUMNS)
        for run in runs:
            for staleness in sorted(run.staleness):
                out.writerow([run.label, run.seed, staleness, run.staleness[staleness]])
    return paths


def curve(runs: Sequence[TrainingRun]) -> tuple[list[float], list[float], list[float], list[float]]:
    """(times, mean, low, high) of accuracy over seeds on the union of their evaluation
    times; a seed's accuracy at a time is its latest evaluation (after its end: its last)."""
    times = sorted({e.virtual_seconds for run in runs for e in run.evaluations})
    means, lows, highs = [], [], []
    for t in times:
        values = []
        for run in runs:
            latest = run.evaluations[0].accuracy
            for e in run.evaluations:
                if e.virtual_seconds > t:
                    break
                latest = e.accuracy
            values.append(latest)
        means.append(statistics.fmean(values))
        lows.append(min(values))
        highs.append(max(values))
    return times, means, lows, highs


def summary(runs: Sequence[TrainingRun], targets: Sequence[float]) -> list[dict[str, str]]:
    """Per method: final accuracy (mean over seeds), virtual seconds, updates, mean staleness
    and mean time to each target (reached/seeds): the CLI's table."""
    table = []
    ttas = time_to_accuracy(runs, targets)
    for method in methods(runs):
        mine = [run for run in runs if run.label == method]
        grads = sum(sum(run.staleness.values()) for run in mine)
        stale = sum(k * v for run in mine for k, v in run.staleness.items())
        row = {
            "method": method,
            "final accuracy": f"{statistics.fmean(r.evaluations[-1].accuracy for r in mine):.3f}",
            "virtual s": f"{statistics.fmean(r.virtual_seconds for r in mine):.1f}",
            "updates": f"{statistics.fmean(r.updates for r in mine):.0f}",
            "mean staleness": f"{stale / grads:.2f}" if grads else "-",
        }
        for tta in ttas:
            if tta.method == method:
                when = "-" if tta.mean is None else f"{tta.mean:.1f}"
                row[f"t({tta.target:g}) s"] = f"{when} ({tta.reached}/{tta.seeds})"
        table.append(row)
    return table


def plot(
    runs: Sequence[TrainingRun], targets: Sequence[float], directory: Path, title: str = ""
) -> list[Path]:
    """accuracy.png (mean and min-max band over seeds per method vs virtual time) and
    time_to_accuracy.png (mean time per target and method, 95 % t-interval bars)."""
    try:
        import matplotlib  # lazily: only plotting needs it, and never a display

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            f"the plots need matplotlib ({exc.name or 'matplotlib'} is missing): {SIM_EXTRA}"
        ) from None
    paths = [directory / "accuracy.png", directory / "time_to_accuracy.png"]
    names = methods(runs)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        for i, method in enumerate(names):
            times, mean, low, high = curve([run for run in runs if run.label == method])
            color = f"C{i % 10}"
            ax.step(times, mean, where="post", label=method, color=color)
            ax.fill_between(times, low, high, step="post", alpha=0.2, color=color)
        ax.set_xlabel("virtual seconds")
        ax.set_ylabel("test accuracy (mean, band: min-max over seeds)")
        if title:
            ax.set_title(title, fontsize="medium")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(paths[0])
    finally:
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        rows = time_to_accuracy(runs, targets)
        width = 0.8 / max(len(names), 1)
        for i, method in enumerate(names):
            xs, heights, errors = [], [], [[], []]
            for j, target in enumerate(targets):
                row = next(r for r in rows if r.method == method and r.target == target)
                x = j + (i - (len(names) - 1) / 2) * width
                # how many seeds reached it, over the bar (at the axis when none did)
                ax.annotate(
                    f"{row.reached}/{row.seeds}",
                    (x, row.high or row.mean or 0.0),
                    textcoords="offset points",
                    xytext=(0, 2),
                    ha="center",
                    fontsize="x-small",
                )
                xs.append(
                    x
                )  # a bar of height 0 when no seed reached it (keeps the legend's colour)
                heights.append(row.mean or 0.0)
                errors[0].append(0.0 if row.low is None or row.mean is None else row.mean - row.low)
                errors[1].append(
                    0.0 if row.high is None or row.mean is None else row.high - row.mean
                )
            ax.bar(xs, heights, width, yerr=errors, capsize=3, label=method, color=f"C{i % 10}")
        ax.set_xticks(range(len(targets)), [f"{t:g}" for t in targets])
        ax.set_xlabel("target test accuracy")
        ax.set_ylabel("virtual seconds to reach it (95 % t-interval)")
        ax.set_xlim(-0.5, len(targets) - 0.5)
        if title:
            ax.set_title(title, fontsize="medium")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(paths[1])
    finally:
        plt.close(fig)
    return paths
