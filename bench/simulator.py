"""Simulator speed and the PSP beta sweep.

    python bench/simulator.py                 # parts 1 to 3
    python bench/simulator.py --skip-large    # without the 10,000-worker run
    python bench/simulator.py --scale         # part 4 only (several minutes)

1. The reference experiment (200 workers, 200 simulated s, 1 s + Exp(1 s)) for
   BSP, ASP, SSP(4), pBSP(10), pSSP(4, 10): target < 2 s of wall time in total.
2. 10,000 workers over 200 simulated s with pSSP(4, 10): target < 60 s.
3. pBSP's beta over 0..64: mean final step falls monotonically from ASP to BSP.
4. Scale: every method at 10,000 and 100,000 workers over 200 simulated s, target
   < 60 s each; at 10,000 also the engine before the scale rewrite (read from git
   at OLD_ENGINE, in this process) where it finishes in reasonable time, and new/old.
   Wall and CPU seconds: on a shared machine CPU seconds are the steadier figure.
Sampled methods use per-check sampling (the reference) unless --sample-timing says otherwise.
"""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

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
SCALE = "bsp,ssp:4,asp,pbsp:10,pssp:4:10,dssp:2:6"
OLD_ENGINE = "ba3c2a6"  # the last commit before the scale rewrite (issue 20)
OLD_TOO_SLOW = {"pbsp(beta=10)"}  # per-check pBSP: about 215 s at 10,000 workers


def old_engine() -> ModuleType | None:
    """coordinator/simulator/engine.py as of OLD_ENGINE, or None outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        source = subprocess.run(
            ["git", "show", f"{OLD_ENGINE}:coordinator/simulator/engine.py"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "old_engine.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_engine", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_engine"] = module
    spec.loader.exec_module(module)
    return module


def clocked(
    run: Callable[..., Result], *args: object, **kwargs: object
) -> tuple[Result, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = run(*args, **kwargs)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def scale(seed: int, timing: SampleTiming, sizes: list[int], barriers: str, old: bool) -> None:
    from coordinator.barriers.arguments import barrier_list

    console = Console()
    before = old_engine() if old else None
    if old and before is None:
        console.print(f"no git history: the old engine ({OLD_ENGINE}) is not compared")
    table = Table(title=f"scale: 200 simulated s, 1 s + Exp(1 s), seed {seed}, {timing.value}")
    table.add_column("method")
    for size in sizes:
        table.add_column(f"P={size:,} wall s", justify="right")
        table.add_column("cpu s", justify="right")
    if before is not None:
        table.add_column(f"old P={sizes[0]:,} wall s", justify="right")
        table.add_column("cpu s", justify="right")
        table.add_column("new/old cpu", justify="right")
    worst = 0.0
    for spec in barrier_list(barriers):
        row = [str(spec)]
        new_cpu = []
        for size in sizes:
            result, wall, cpu = clocked(simulate, spec, size, 200.0, seed=seed, timing=timing)
            worst = max(worst, wall)
            new_cpu.append(cpu)
            row += [f"{wall:.1f}", f"{cpu:.1f}"]
            console.print(
                f"  {result.label} P={size:,}: {wall:.1f} s wall, {cpu:.1f} s cpu, "
                f"{result.events} steps, mean step {result.mean_step:.2f}"
            )
        if before is not None:
            if str(spec) in OLD_TOO_SLOW and spec.sampled and timing == SampleTiming.PER_CHECK:
                row += ["-", "-", "-"]
            else:
                _, wall, cpu = clocked(
                    before.simulate, spec, sizes[0], 200.0, seed=seed, timing=timing
                )
                row += [f"{wall:.1f}", f"{cpu:.1f}", f"{new_cpu[0] / cpu:.2f}"]
        table.add_row(*row)
    console.print(table)
    verdict = "ok" if worst < 60 else "MISSED"
    console.print(f"slowest run: {worst:.1f} s wall (target < 60 s each: {verdict})")


def timed(spec: BarrierSpec, workers: int, seed: int, timing: SampleTiming) -> tuple[Result, float]:
    began = time.perf_counter()
    result = simulate(spec, workers, 200.0, seed=seed, timing=timing)
    return result, time.perf_counter() - began


def main(
    seed: int = 0,
    sample_timing: str = "per-check",
    skip_large: bool = typer.Option(False, help="skip the 10,000-worker run"),
    scale_only: bool = typer.Option(False, "--scale", help="run only part 4, the scale runs"),
    sizes: str = typer.Option("10000,100000", help="part 4: worker counts, comma-separated"),
    barriers: str = typer.Option(SCALE, help="part 4: methods, as simulate --barrier"),
    old: bool = typer.Option(True, help="part 4: also time the old engine at the first size"),
) -> None:
    timing = SampleTiming(sample_timing)
    if scale_only:
        scale(seed, timing, [int(size) for size in sizes.split(",")], barriers, old)
        return
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
