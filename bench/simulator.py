"""Simulator speed and the PSP beta sweep.

    python bench/simulator.py                 # all three parts
    python bench/simulator.py --skip-large    # without the 10,000-worker run

1. The reference experiment (200 workers, 200 simulated s, 1 s + Exp(1 s)) for
   BSP, ASP, SSP(4), pBSP(10), pSSP(4, 10): target < 2 s of wall time in total.
2. 10,000 workers over 200 simulated s with pSSP(4, 10): target < 60 s.
3. pBSP's beta over 0..64: mean final step falls monotonically from ASP to BSP.
Sampled methods use per-check sampling (the reference) unless --sample-timing says otherwise.
"""

from __future__ import annotations

import itertools
import time

import typer
from rich.console import Console
from rich.table import Table

from coordinator.barriers.policy import BarrierSpec, Method, SampleTiming
from coordinator.simulator.engine import Result, simulate

REFERENCE = [
    BarrierSpec(Method.BSP),
    BarrierSpec(Method.ASP),
    BarrierSpec(Method.SSP, staleness=4),
    BarrierSpec(Method.PBSP, sample=10),
    BarrierSpec(Method.PSSP, staleness=4, sample=10),
]
BETAS = [0, 1, 2, 4, 8, 16, 32, 64]


def timed(spec: BarrierSpec, workers: int, seed: int, timing: SampleTiming) -> tuple[Result, float]:
    began = time.perf_counter()
    result = simulate(spec, workers, 200.0, seed=seed, timing=timing)
    return result, time.perf_counter() - began


def main(
    seed: int = 0,
    sample_timing: str = "per-check",
    skip_large: bool = typer.Option(False, help="skip the 10,000-worker run"),
) -> None:
    timing = SampleTiming(sample_timing)
    console = Console()

    table = Table(title=f"reference: 200 workers, 200 s, 1 s + Exp(1 s), seed {seed}")
    for column in ("method", "mean step", "min", "max", "mean wait s", "max gap", "wall s"):
        table.add_column(column, justify="left" if column == "method" else "right")
    total = 0.0
    for spec in REFERENCE:
        result, wall = timed(spec, 200, seed, timing)
        total += wall
        table.add_row(
            result.label,
            f"{result.mean_step:.1f}",
            str(min(result.final_step)),
            str(max(result.final_step)),
            f"{result.mean_wait:.1f}",
            str(result.largest_gap),
            f"{wall:.3f}",
        )
    console.print(table)
    verdict = "ok" if total < 2 else "MISSED"
    console.print(f"five methods: {total:.2f} s wall (target < 2 s: {verdict})")

    if not skip_large:
        result, wall = timed(REFERENCE[-1], 10_000, seed, timing)
        verdict = "ok" if wall < 60 else "MISSED"
        console.print(
            f"10,000 workers, {result.label}: {wall:.1f} s wall (target < 60 s: {verdict}); "
            f"{result.events} steps, {result.checks} checks, mean step {result.mean_step:.1f}"
        )

    sweep = Table(title="pBSP beta sweep (200 workers, 200 s)")
    for column in ("beta", "mean step", "min", "max", "max gap"):
        sweep.add_column(column, justify="right")
    means = []
    for beta in BETAS:
        result, _ = timed(BarrierSpec(Method.PBSP, sample=beta), 200, seed, timing)
        means.append(result.mean_step)
        sweep.add_row(
            str(beta),
            f"{result.mean_step:.1f}",
            str(min(result.final_step)),
            str(max(result.final_step)),
            str(result.largest_gap),
        )
    console.print(sweep)
    monotone = all(a >= b for a, b in itertools.pairwise(means))
    console.print(f"mean step non-increasing in beta: {monotone}")


if __name__ == "__main__":
    typer.run(main)
