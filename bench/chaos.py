"""Chaos soak: the whole product on a 3-member etcd, under load, while things die; the soak
and what must hold are tests/support/chaos.py's (the suite's short soak runs it too).

    python bench/chaos.py                          # 10 minutes, 200 jobs
    python bench/chaos.py --seconds 60 --jobs 20   # the suite's short soak
    python bench/chaos.py --seed 7 --keep          # again, keeping the logs
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.chaos import console, print_report, soak


def main(
    seconds: float = typer.Option(600, help="how long jobs are submitted (faults meanwhile)"),
    jobs: int = typer.Option(200, min=1, help="jobs submitted, evenly over --seconds"),
    seed: int = typer.Option(0, help="the jobs and the faults' targets"),
    fault_every: float = typer.Option(15, help="mean seconds between faults"),
    keep: bool = typer.Option(False, help="keep the folder with every process's log"),
) -> None:
    root = Path(tempfile.mkdtemp(prefix="chaos-"))
    report = soak(seconds, jobs, seed, fault_every, root)
    print_report(report)
    if keep or report.problems:
        console.print(f"logs: {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    raise typer.Exit(1 if report.problems else 0)


if __name__ == "__main__":
    typer.run(main)
