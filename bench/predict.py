"""The simulator's prediction of live runs: total training time and time to accuracy.

For each method, setting (uniform, or the last trainer a 3x straggler) and seed,
a live `mnist` job (1 server, `--trainers` trainers, real processes, embedded
etcd) trains and records every trainer's step durations (`step_times.csv`: from
the barrier letting a step start to the trainer's next barrier call; barrier
waits left out) and its evaluation curve (server 0, every `--eval-seconds` of
wall time, or back to back when an evaluation takes longer). The simulator then
trains the same model on the same shards with the same optimizer (the job's own
`parse`), replaying those durations as its delay model (`trace:`, no transfer
added: the trace holds it), under the same barrier decisions (pBSP and pSSP draw one
sample per step, as the live barrier does), and predicts:

- the whole run's training time (error = predicted / live - 1);
- the time to each of `--targets`. The live time is only known to lie between
  the last evaluation below the target and the first at or above it; the error
  is the prediction's distance outside that interval, over the live time (0 when
  the prediction falls inside it).

    python bench/predict.py                               # bsp, ssp, asp; 1 seed
    python bench/predict.py --methods all --seeds 3 --trainers 3 --straggler both \
        --momentum 0.5 --update-rule plain --out docs/methods/live   # updates as given
    python bench/predict.py --replot --out docs/methods/live
    python bench/predict.py --methods all --seeds 3 --trainers 3 --epochs 5 \
        --straggler on --targets 0.85,0.9 --out docs/methods/live_defaults   # at the
        # defaults (docs/methods/update_rules.md), ~35 min

The optimizer is the job's default (SGD lr 0.02, momentum 0.9, each method's default
update rule, docs/methods/update_rules.md) unless --lr, --momentum or --update-rule say
otherwise. (Before the update rules, momentum 0.9 with gradients applied one by one was
on the edge of stability, and runs were made with momentum 0.5.)

With `--out`: `runs.json` (every run, its curves), `live_vs_simulated.md` and `.csv`
(per method and setting: live and predicted time to each target, mean and 95 %
interval over the seeds) and `live_vs_simulated.png`.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from methods import COLORS, LABELS, METHODS, Run, run_one  # bench/methods.py

from coordinator.barriers.policy import SampleTiming
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.jobs.mnist import parse
from coordinator.simulator.delays import Trace
from coordinator.simulator.train_report import mean_interval
from coordinator.simulator.training import Transfer, train
from coordinator.simulator.training_data import TrainingData
from coordinator.simulator.training_results import TrainingRun

console = Console(width=160)
NO_TRANSFER = Transfer(latency=0.0, bandwidth=1e18)  # the trace's durations include it
SETTINGS = {"off": [False], "on": [True], "both": [False, True]}


def simulate_live(
    params: dict[str, str], world_size: int, trace: Path, eval_seconds: float
) -> TrainingRun:
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
        rule=options.rule,
        aggregate=options.aggregate,
        eval_seconds=eval_seconds,
        transfer=NO_TRANSFER,
        timing=SampleTiming.PER_STEP,  # the live sampled barrier's: one sample per step
        own_shards=True,  # each trainer its own shard's epochs, as live
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


def shown(values: list[float], seeds: int) -> str:
    """`mean [low, high] (reached/seeds)`, or `never (0/seeds)`."""
    if not values:
        return f"never (0/{seeds})"
    mean, half = mean_interval(values)
    band = "" if half is None else f" [{mean - half:.2f}, {mean + half:.2f}]"
    return f"{mean:.2f}{band} ({len(values)}/{seeds})"


def live_runs(
    chosen: list[str], settings: list[bool], seeds: int, trainers: int, epochs: int,
    eval_seconds: float, targets: list[float], optimizer: dict[str, str],
) -> list[dict[str, Any]]:  # fmt: skip
    """Every live run and its prediction: one record per (setting, method, seed)."""
    world_size = trainers + 1
    records = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with (
        tempfile.TemporaryDirectory() as scratch,
        EmbeddedEtcd() as etcd,
        Progress(*columns, console=console, transient=True) as progress,
    ):
        etcd.security.export()  # members log in as root (auth is on)
        overall = progress.add_task("runs", total=len(chosen) * len(settings) * seeds)
        for straggler in settings:
            for method in chosen:
                for seed in range(seeds):
                    artifacts = Path(scratch) / "artifacts"
                    params = {
                        **METHODS[method], "epochs": str(epochs), "seed": str(seed),
                        "eval_seconds": str(eval_seconds), "artifacts": str(artifacts),
                        **optimizer,
                    }  # fmt: skip
                    if straggler:
                        params |= {"straggler_rank": str(trainers), "straggler_factor": "3"}
                    run = Run(method, straggler)
                    task = progress.add_task(f"{method} {run.setting} seed {seed}", total=None)
                    summary = run_one(etcd.endpoint, artifacts, run, params, world_size,
                                      progress, task)  # fmt: skip
                    progress.update(task, description=f"{method} seed {seed}: simulating")
                    simulated = simulate_live(
                        params, world_size, Path(summary["step_times_path"]), eval_seconds
                    )
                    progress.remove_task(task)
                    progress.advance(overall)
                    records.append({
                        "method": method, "setting": run.setting, "seed": seed,
                        "live_seconds": summary["seconds"],
                        "predicted_seconds": simulated.virtual_seconds,
                        "live_curve": [[m["t"], m["accuracy"]] for m in summary["metrics"]],
                        "predicted_curve": [[e.virtual_seconds, e.accuracy]
                                            for e in simulated.evaluations],
                        "targets": {f"{t:g}": {"live": live_interval(summary["metrics"], t),
                                               "predicted": simulated.time_to(t)}
                                    for t in targets},
                    })  # fmt: skip
    return records


def per_run_table(records: list[dict[str, Any]], targets: list[str]) -> Table:
    table = Table(title="each run: live, and simulated from its own trace")
    for column in ("method", "setting", "seed", "live s", "predicted s", "error"):
        table.add_column(column, justify="left" if column in ("method", "setting") else "right")
    for target in targets:
        table.add_column(f"live to {target}", justify="right")
        table.add_column("predicted", justify="right")
        table.add_column("error", justify="right")
    for r in records:
        cells = [LABELS[r["method"]], r["setting"], str(r["seed"]), f"{r['live_seconds']:.2f}",
                 f"{r['predicted_seconds']:.2f}",
                 f"{r['predicted_seconds'] / r['live_seconds'] - 1:+.0%}"]  # fmt: skip
        for target in targets:
            live, predicted = r["targets"][target]["live"], r["targets"][target]["predicted"]
            cells.append("never" if live is None else f"{live[0]:.2f}-{live[1]:.2f}")
            cells.append("never" if predicted is None else f"{predicted:.2f}")
            both = live is not None and predicted is not None
            cells.append(f"{outside(predicted, live):+.0%}" if both else "")
        table.add_row(*cells)
    return table


def summary_rows(records: list[dict[str, Any]], targets: list[str]) -> list[dict[str, str]]:
    """Per (method, setting): live and predicted times, mean [95 %] (reached/seeds), and the
    mean |error| over the runs where both reached the target. Live time: the first
    evaluation at or above the target."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["setting"], r["method"]), []).append(r)
    rows = []
    for (setting, method), runs in groups.items():
        totals = [abs(r["predicted_seconds"] / r["live_seconds"] - 1) for r in runs]
        row = {"method": LABELS[method], "setting": setting,
               "live s": shown([r["live_seconds"] for r in runs], len(runs)),
               "predicted s": shown([r["predicted_seconds"] for r in runs], len(runs)),
               "|error|": f"{statistics.fmean(totals):.0%}"}  # fmt: skip
        for target in targets:
            at = [r["targets"][target] for r in runs]
            live = [t["live"][1] for t in at if t["live"] is not None]
            predicted = [t["predicted"] for t in at if t["predicted"] is not None]
            errors = [abs(outside(t["predicted"], t["live"])) for t in at
                      if t["live"] is not None and t["predicted"] is not None]  # fmt: skip
            row[f"live to {target}"] = shown(live, len(runs))
            row[f"predicted to {target}"] = shown(predicted, len(runs))
            row[f"|error| to {target}"] = f"{statistics.fmean(errors):.0%}" if errors else ""
        rows.append(row)
    return rows


def write_summary(rows: list[dict[str, str]], out: Path) -> None:
    header = list(rows[0])
    with (out / "live_vs_simulated.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(":---" if h in ("method", "setting") else "---:" for h in header) + "|",
    ]
    lines += ["| " + " | ".join(row[h] for h in header) + " |" for row in rows]  # fmt: skip
    (out / "live_vs_simulated.md").write_text("\n".join(lines) + "\n")


def plot(records: list[dict[str, Any]], target: str, out: Path) -> None:
    """Top: seed 0's accuracy against seconds, live (solid) and simulated (dashed), per
    setting. Bottom: time to `target`, live and predicted, mean and 95 % interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["setting"] for r in records))
    methods = list(dict.fromkeys(r["method"] for r in records))
    figure, axes = plt.subplots(2, len(settings), figsize=(6.5 * len(settings), 8), squeeze=False)
    for column, setting in enumerate(settings):
        top, bottom = axes[0][column], axes[1][column]
        for method in methods:
            first = [r for r in records if (r["setting"], r["method"], r["seed"]) ==
                     (setting, method, 0)]  # fmt: skip
            for r in first:
                for curve, style in (("live_curve", "-"), ("predicted_curve", "--")):
                    xs, ys = zip(*r[curve], strict=True) if r[curve] else ((), ())
                    top.plot(xs, ys, style, color=COLORS[method], linewidth=1.2,
                             label=LABELS[method] if style == "-" else None)  # fmt: skip
        top.set(title=f"{setting}: seed 0, live (solid) and simulated (dashed)",
                xlabel="seconds", ylabel="test accuracy", ylim=(0.5, 1.0))  # fmt: skip
        top.legend(fontsize=8, loc="lower right")
        for index, method in enumerate(methods):
            mine = [r["targets"][target] for r in records
                    if (r["setting"], r["method"]) == (setting, method)]  # fmt: skip
            for offset, (values, hatch) in enumerate((
                ([t["live"][1] for t in mine if t["live"] is not None], ""),
                ([t["predicted"] for t in mine if t["predicted"] is not None], "//"),
            )):  # fmt: skip
                if not values:
                    continue
                mean, half = mean_interval(values)
                bottom.bar(index + 0.4 * offset, mean, width=0.38, color=COLORS[method],
                           hatch=hatch, edgecolor="black", yerr=half or 0.0, capsize=3)  # fmt: skip
        bottom.set_xticks([i + 0.2 for i in range(len(methods))],
                          [LABELS[m] for m in methods], rotation=20, fontsize=8)  # fmt: skip
        bottom.set(title=f"{setting}: seconds to {target}, live (plain) and predicted (hatched)",
                   ylabel="seconds")  # fmt: skip
    figure.tight_layout()
    figure.savefig(out / "live_vs_simulated.png", dpi=110)
    plt.close(figure)


def main(
    methods: Annotated[str, typer.Option(help="comma-separated, of bench/methods.py's, or all")] = (
        "bsp,ssp,asp"
    ),
    seeds: Annotated[int, typer.Option(min=1, help="live runs per method (seeds 0..K-1)")] = 1,
    trainers: Annotated[int, typer.Option(min=1)] = 2,
    epochs: Annotated[int, typer.Option(min=1)] = 5,
    targets: Annotated[str, typer.Option(help="comma-separated accuracies in (0, 1]")] = "0.9,0.95",
    eval_seconds: Annotated[float, typer.Option(min=0.05)] = 0.1,
    straggler: Annotated[str, typer.Option(help="the last trainer 3x slower: off, on or both")] = (
        "off"
    ),
    lr: Annotated[float | None, typer.Option(min=0.0, help="default: the job's")] = None,
    momentum: Annotated[float | None, typer.Option(min=0.0, max=0.99)] = None,
    update_rule: Annotated[str | None, typer.Option(help="default: the method's")] = None,
    out: Annotated[Path | None, typer.Option(help="write the tables, runs and plot here")] = None,
    replot: Annotated[bool, typer.Option(help="only redo tables and plot from --out")] = False,
) -> None:
    chosen = list(METHODS) if methods == "all" else [m.strip() for m in methods.split(",") if m]
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        raise typer.BadParameter(f"unknown: {', '.join(unknown)}", param_hint="--methods")
    if straggler not in SETTINGS:
        raise typer.BadParameter(f"{straggler!r} is not off, on or both", param_hint="--straggler")
    try:
        wanted = [float(t) for t in targets.split(",")]
    except ValueError:
        raise typer.BadParameter(
            f"{targets!r} is not a list of numbers", param_hint="--targets"
        ) from None
    if not wanted or not all(0 < t <= 1 for t in wanted):
        raise typer.BadParameter("each target must lie in (0, 1]", param_hint="--targets")
    given = {"lr": lr, "momentum": momentum, "update_rule": update_rule}
    optimizer = {name: str(value) for name, value in given.items() if value is not None}
    if replot:
        if out is None:
            raise typer.BadParameter("--replot needs --out", param_hint="--out")
        records = json.loads((out / "runs.json").read_text())
    else:
        records = live_runs(chosen, SETTINGS[straggler], seeds, trainers, epochs, eval_seconds,
                            wanted, optimizer)  # fmt: skip
    names = list(records[0]["targets"])
    console.print(per_run_table(records, names))
    rows = summary_rows(records, names)
    summary = Table(title="per method: mean [95 % interval] (reached/seeds), seconds")
    for column in rows[0]:
        summary.add_column(column, justify="left" if column in ("method", "setting") else "right")
    for row in rows:
        summary.add_row(*row.values())
    console.print(summary)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if not replot:
            (out / "runs.json").write_text(json.dumps(records, indent=1) + "\n")
        write_summary(rows, out)
        plot(records, names[-1], out)
        console.print(f"wrote {out}/live_vs_simulated.md, .csv, .png and runs.json")


if __name__ == "__main__":
    typer.run(main)
