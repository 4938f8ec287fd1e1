"""The update rules' study in virtual time: which rule and lr each method gets by default.

Every run is the simulator's (`coordinator.simulator.training.train`, what
`coordinator simulate --train mnist` runs): the real `MnistNet`, real gradients, the live
barrier code and the live server's update code, in virtual time. Settings are the CLI's
defaults (SGD lr 0.02, momentum 0.9, lr decay 0.7 per epoch, the job's batch: 32 a
trainer up to P = 8, then 256 / P, at least 8; 0.5 ms + 10 Gbit/s transfers); a run stops
at its first evaluation at the target, or after its epochs.

    python bench/update_rules.py                   # defaults vs plain, digits (~90 min)
    python bench/update_rules.py --part rules      # every rule for every method (~40 min)
    python bench/update_rules.py --part fashion    # Fashion-MNIST, P=16 and 64 (~52 min)
    python bench/update_rules.py --part lr --settings 2   # the lr at P=16 (~17 min)
    python bench/update_rules.py --part fashion --settings 2 --seeds 3 --batch 32

Parts:
- defaults: digits, P = 4 (3 epochs, target 0.9), P = 16 (4 epochs, target 0.85) and
  P = 64 (8 epochs, target 0.85), with and without a 3x straggler (a quarter of the
  trainers), every method, `--seeds` seeds, under its default rule and under `plain`. Then
  the time-to-accuracy ratio at P = 16 with the straggler: the soonest stale method
  against BSP-aggregate, both at their defaults.
- rules: the same digits settings with the straggler, every rule for every method.
- fashion: the 60,000 Fashion-MNIST images (/usr/share/datasets/fashion-mnist), P = 16
  and 64, 2 epochs, target 0.8, defaults.
- lr: the digits settings, every method at its default rule, under each lr of `LRS`.

`--batch` sets every trainer's batch instead of the job's default (`default_batch`): a
round of P trainers' batches moves about as far as one trainer's step, so a larger batch
at large P leaves too few rounds in a few epochs.

Prints each table and writes it as markdown and CSV under --out (default
docs/methods/update_rules/).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.barriers.policy import BarrierSpec, Method  # noqa: E402
from coordinator.ps.rules import default_batch  # noqa: E402
from coordinator.simulator.train_report import mean_interval  # noqa: E402

console = Console(width=170)
METHODS = ["bsp", "ssp:3", "asp", "pbsp:2", "pssp:3:2", "dssp:3:12", "bsp-agg"]
RULES = ["plain", "scaled", "async", "staleness", "dc"]
LRS = [0.01, 0.015, 0.02, 0.03, 0.04]
DEFAULT_LR = 0.02
FASHION = "/usr/share/datasets/fashion-mnist"


@dataclass(frozen=True)
class Setting:
    name: str
    data: str
    workers: int
    delay: str
    epochs: float
    target: float
    test_rows: int
    batch: int | None = None  # None: the job's default_batch(P)

    @property
    def batch_size(self) -> int:
        return self.batch or default_batch(self.workers)


DIGITS = [
    Setting("P=4, straggler", "digits", 4, "straggler:0.25,3", 3, 0.9, 500),
    Setting("P=16, straggler", "digits", 16, "straggler:0.25,3", 4, 0.85, 500),
    Setting("P=4, no straggler", "digits", 4, "exp:1,1", 3, 0.9, 500),
    Setting("P=16, no straggler", "digits", 16, "exp:1,1", 4, 0.85, 500),
    Setting("P=64, straggler", "digits", 64, "straggler:0.25,3", 8, 0.85, 500),
    Setting("P=64, no straggler", "digits", 64, "exp:1,1", 8, 0.85, 500),
]
FASHION_SETTINGS = [
    Setting("Fashion P=16, straggler", FASHION, 16, "straggler:0.25,3", 2, 0.8, 2000),
    Setting("Fashion P=64, straggler", FASHION, 64, "straggler:0.25,3", 2, 0.8, 2000),
]


@lru_cache(maxsize=2)
def _data(path: str, workers: int, test_rows: int):  # type: ignore[no-untyped-def]
    from coordinator.datasets.mnist import parse_mnist
    from coordinator.simulator.training_data import TrainingData

    return TrainingData.load(parse_mnist(path, field="data"), workers, test_rows)


Job = tuple[Setting, str, str | None, float, int]


def _run(job: Job) -> dict:
    """One simulated run: (setting, method, rule or None for the default, lr, seed)."""
    from coordinator.barriers.arguments import barrier_list
    from coordinator.ps.optim import OptimizerSpec
    from coordinator.ps.rules import UpdateRule
    from coordinator.simulator import training
    from coordinator.simulator.delays import parse_delay

    setting, method, rule, lr, seed = job
    aggregate = method == "bsp-agg"
    spec = BarrierSpec(Method.BSP) if aggregate else barrier_list(method)[0]
    data = _data(setting.data, setting.workers, setting.test_rows)
    delay = parse_delay(setting.delay)
    batch = setting.batch_size
    every = training.updates_per_epoch(data, batch, aggregate)
    started = time.monotonic()
    run = training.train(
        spec, data, epochs=setting.epochs, delay=delay, seed=seed,
        optimizer=OptimizerSpec("sgd", lr, 0.9, decay=0.7, decay_every=every),
        rule=None if rule is None else UpdateRule(rule), aggregate=aggregate,
        batch_size=batch,
        eval_seconds=training.default_eval_seconds(
            delay, data, batch, setting.epochs, None) / 2,
        stop_accuracy=setting.target,
    )  # fmt: skip
    grads = sum(run.staleness.values())
    return {
        "setting": setting.name, "method": method, "seed": seed,
        "rule": (rule or "default") + ("" if lr == DEFAULT_LR else f", lr {lr:g}"),
        "reached": run.time_to(setting.target), "last": run.evaluations[-1].accuracy,
        "best": max(e.accuracy for e in run.evaluations),
        "staleness": sum(k * v for k, v in run.staleness.items()) / grads if grads else 0.0,
        "wall": time.monotonic() - started,
    }  # fmt: skip


def run_all(jobs: list[Job], processes: int) -> list[dict]:
    """Every job's result, in the jobs' order, with a bar of the runs done."""
    columns = (TextColumn("runs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    results = []
    with Progress(*columns, console=console) as bar, ProcessPoolExecutor(processes) as pool:
        task = bar.add_task("runs", total=len(jobs))
        for result in pool.map(_run, jobs, chunksize=1):
            results.append(result)
            bar.advance(task)
    return results


def interval(values: list[float]) -> str:
    if not values:
        return "-"
    mean, half = mean_interval(values)
    return f"{mean:.0f}" if half is None else f"{mean:.0f} [{mean - half:.0f}, {mean + half:.0f}]"


def table(results: list[dict], setting: Setting, out: Path, tag: str) -> list[list[str]]:
    """Per (method, rule): reached/seeds, mean time to the target [95 % t-interval] over the
    seeds that reached it, best and last accuracy, mean staleness."""
    header = ["method", "rule", "reached", f"t({setting.target:g}) s", "best acc", "last acc",
              "mean staleness"]  # fmt: skip
    rows = []
    mine = [r for r in results if r["setting"] == setting.name]
    for key in dict.fromkeys((r["method"], r["rule"]) for r in mine):
        runs = [r for r in mine if (r["method"], r["rule"]) == key]
        times = [r["reached"] for r in runs if r["reached"] is not None]
        rows.append([
            *key, f"{len(times)}/{len(runs)}", interval(times),
            f"{statistics.fmean(r['best'] for r in runs):.3f}",
            f"{statistics.fmean(r['last'] for r in runs):.3f}",
            f"{statistics.fmean(r['staleness'] for r in runs):.2f}",
        ])  # fmt: skip
    title = (
        f"{setting.name}: {setting.data.split('/')[-1]}, {setting.epochs:g} epochs, "
        f"batch {setting.batch_size}"
    )
    batch = "" if setting.batch is None else f", batch {setting.batch}"  # a batch given
    shown = Table(title=title)
    for column in header:
        shown.add_column(column, justify="left" if column in ("method", "rule") else "right")
    for row in rows:
        shown.add_row(*row)
    console.print(shown)
    out.mkdir(parents=True, exist_ok=True)
    name = (setting.name + batch).replace(", ", "_").replace(" ", "_").replace("=", "")
    stem = out / f"{tag}_{name}"
    with stem.with_suffix(".csv").open("w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |",
             "|:---|:---|" + "---:|" * (len(header) - 2)]  # fmt: skip
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return rows


def speed_ratio(results: list[dict], setting: Setting) -> str:
    """The soonest stale method against BSP-aggregate, both at their defaults."""

    def times(method: str) -> list[float]:
        runs = [r for r in results if (r["setting"], r["method"], r["rule"])
                == (setting.name, method, "default")]  # fmt: skip
        return [r["reached"] for r in runs if r["reached"] is not None]

    stale = [m for m in METHODS if m not in ("bsp", "bsp-agg") and times(m)]
    best = min(stale, key=lambda m: statistics.fmean(times(m)))
    agg = times("bsp-agg")
    if not agg:
        return f"{setting.name}: BSP-aggregate never reached {setting.target}"
    ratio = statistics.fmean(agg) / statistics.fmean(times(best))
    return (f"{setting.name}: {best} reaches {setting.target:g} {ratio:.2f}x sooner than "
            f"bsp-agg ({interval(times(best))} s against {interval(agg)} s)")  # fmt: skip


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part", choices=["defaults", "rules", "fashion", "lr"], default="defaults"
    )
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--batch", type=int, help="every trainer's batch (default: the job's)")
    parser.add_argument("--jobs", type=int, default=2, help="processes")
    parser.add_argument("--settings", default="", help="comma-separated setting numbers (1-6)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", type=Path, default=ROOT / "docs/methods/update_rules")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    settings = FASHION_SETTINGS if args.part == "fashion" else DIGITS
    if args.part == "rules":
        settings = [s for s in DIGITS if "no straggler" not in s.name]
    if args.settings:
        settings = [settings[int(i) - 1] for i in args.settings.split(",")]
    settings = [replace(s, batch=args.batch) for s in settings]
    rules: list[str | None] = [None, "plain"] if args.part == "defaults" else [None]
    if args.part == "rules":
        rules = list(RULES)
    lrs = LRS if args.part == "lr" else [DEFAULT_LR]
    jobs = [(s, m, r, lr, seed) for s in settings for m in methods for r in rules
            for lr in lrs for seed in range(args.seeds)]  # fmt: skip
    started = time.monotonic()
    results = run_all(jobs, args.jobs)
    for setting in settings:
        table(results, setting, args.out, args.part)
    if args.part == "defaults" and any(s.name == "P=16, straggler" for s in settings):
        line = speed_ratio(results, next(s for s in settings if s.name == "P=16, straggler"))
        console.print(line)
        (args.out / "speed.md").write_text(line + "\n")
    console.print(f"{len(jobs)} runs in {time.monotonic() - started:.0f} s of wall time")


if __name__ == "__main__":
    main(sys.argv[1:])
