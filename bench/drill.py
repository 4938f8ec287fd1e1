"""Kill drill: SIGKILL one member of a live job at a random moment, and check that what
docs/rendezvous.md promises ("Failure semantics") still holds; the trials and what must
hold in each are tests/support/drill.py's (the suite's short drill runs them too).

    python bench/drill.py                     # 100 trials against an embedded etcd
    python bench/drill.py --trials 10 --seed 7
    python bench/drill.py --seed 13 --trial 4 # one trial again, with what it printed
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import typer
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.etcd.server import EmbeddedEtcd
from tests.support.drill import DrillConfig, Trial, report, run_trial

console = Console(width=130)


def main(
    trials: int = typer.Option(100, min=1, help="number of trials"),
    seed: int = typer.Option(13, help="seed of the trials (each trial has its own stream)"),
    trial: int | None = typer.Option(None, help="run only this trial of the seed, verbosely"),
    ttl: int = typer.Option(2, min=2, help="the members' lease TTL (s)"),
    timeout: float = typer.Option(6.0, min=1, help="each phase's deadline (s)"),
    etcd: str | None = typer.Option(None, help="etcd HOST:PORT [an embedded one]"),
) -> None:
    config = DrillConfig(ttl=ttl, timeout=timeout)
    numbers = [trial] if trial is not None else list(range(trials))
    console.print(f"load average: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} cores")
    results: list[Trial] = []
    namespace = f"/drill-{random.SystemRandom().randrange(1 << 32):08x}"
    with EmbeddedEtcd() if etcd is None else _External(etcd) as server:
        if isinstance(server, EmbeddedEtcd):  # members and clients log in as root
            server.security.export()
        started = time.monotonic()
        for number in numbers:
            result = run_trial(server.endpoint, namespace, seed, number, config)
            results.append(result)
            mark = "[red]PROBLEM[/red]" if result.problems else "ok"
            console.print(f"{mark} {result.summary()} ({result.duration:.1f}s)", highlight=False)
            for problem in result.problems:
                console.print(f"    [red]{problem}[/red]", highlight=False)
    for table in report(results, config):
        console.print(table)
    failed = [r for r in results if r.problems]
    console.print(
        f"{len(results)} trials in {time.monotonic() - started:.0f}s; "
        f"{len(failed)} with problems; hangs: "
        f"{sum(p.startswith('hang') for r in results for p in r.problems)}; "
        f"trials with rendezvous keys left: {sum(bool(r.keys_left) for r in results)}"
    )
    raise typer.Exit(1 if failed else 0)


class _External:
    """An etcd the caller runs, used like `EmbeddedEtcd`."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def __enter__(self) -> _External:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


if __name__ == "__main__":
    typer.run(main)
