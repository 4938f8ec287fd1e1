"""Simulation output: one CSV row per worker, and a plot of the step distribution."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from coordinator.simulator.engine import Result

COLUMNS = ["worker", "final_step", "wait_seconds", "max_gap"]

#: How to get the plot: matplotlib is an extra, so a plain install still simulates.
SIM_EXTRA = "pip install 'etcd-coordinator[sim]'"


class PlotUnavailable(RuntimeError):
    """matplotlib (the `sim` extra) is not installed: the numbers exist, the plot cannot."""


def write_csv(results: Sequence[Result], path: Path) -> None:
    """worker, final_step, wait_seconds, max_gap; a leading `method` column if several ran."""
    several = len(results) > 1
    with path.open("w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow((["method"] if several else []) + COLUMNS)
        for result in results:
            for w in range(result.workers):
                row = [w, result.final_step[w], f"{result.wait_seconds[w]:.6f}", result.max_gap[w]]
                out.writerow(([result.label] if several else []) + row)


def summary(result: Result) -> dict[str, float | int | str]:
    """The numbers the CLI's table and the docs show for one run."""
    return {
        "method": result.label,
        "mean_step": round(result.mean_step, 2),
        "min_step": min(result.final_step),
        "max_step": max(result.final_step),
        "mean_wait": round(result.mean_wait, 2),
        "max_gap": result.largest_gap,
    }


def plot(results: Sequence[Result], path: Path, title: str | None = None) -> None:
    """CDF of final steps, one curve per method (the Owl chapter's step-progress figure).

    Raises `PlotUnavailable`, naming the extra, when matplotlib cannot be imported.
    """
    try:
        import matplotlib  # lazily: only plotting needs it, and never a display

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            f"the plot needs matplotlib ({exc.name or 'matplotlib'} is missing): {SIM_EXTRA}"
        ) from None

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        for result in results:
            steps = sorted(result.final_step)
            n = len(steps)
            ax.step(steps, [(i + 1) / n for i in range(n)], where="post", label=result.label)
        ax.set_xlabel("final step")
        ax.set_ylabel("fraction of workers (CDF)")
        if title:
            ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
