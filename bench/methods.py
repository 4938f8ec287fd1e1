"""Time to accuracy per step-barrier method, with and without a straggler, on real training.

The comparison of the DSSP paper (Zhao et al., "Dynamic Stale Synchronous
Parallel Distributed Training for Deep Learning", ICDCS 2019, Table I and
Fig. 4: seconds to reach given test accuracies per method on a heterogeneous
cluster), run on our `mnist` job: one parameter server and `--trainers`
trainers train the same CNN on the same data, with the same seed, once per
method (bsp, ssp(s=3), asp, pbsp(beta=1), pssp(s=3, beta=1),
dssp(S_L=3, S_U=12)), each once with every trainer at full speed and once with
the last trainer a straggler (`straggler_factor=3`: it sleeps twice its
compute time after every gradient).

    python bench/methods.py                          # full Fashion-MNIST, 12 runs (~45 min here)
    python bench/methods.py --data digits --epochs 5 --thresholds 0.90,0.94,0.96
    python bench/methods.py --methods bsp,dssp --straggler on
    python bench/methods.py --replot                 # tables and plot again from runs.json

Writes to `--out` (default docs/methods/fashion/): `methods.csv` and `methods.md` (per
method and straggler setting: seconds from the start of training to the first
evaluation at or above each accuracy threshold, "never" when not reached;
final accuracy; samples/s; mean and max staleness of the applied gradients),
`methods.png` (test accuracy against wall time, and against samples trained,
one curve per method, one panel per straggler setting) and `runs.json` (each
run's summary without the model path, evaluation curve included, plus the mean
1-minute load average of the machine while the run's processes were alive).

Fairness: the runs are sequential, in this process, against one embedded
etcd; each is a fresh job (new id, new artifacts folder). Server 0 evaluates
the whole test set every `--eval-seconds` of wall time whatever the method, so
evaluation takes the same share of the CPU in every run, and the same
training budget (`--epochs` passes over each trainer's shard) is given to all.
Times are wall times from the trainers' common start barrier, so process
start-up and data loading are not counted. On a machine with fewer cores than
processes every member competes for the CPU: see docs/methods/README.md.

DSSP's bounds: S_L = 3 matches SSP's s, so DSSP differs from SSP only by the
extra steps it grants the fastest trainer; S_U = 12 leaves room for up to 9
extra steps, more than a 3x straggler ever justifies (the controller grants
only the steps the fastest can finish before the slowest's next predicted
push, about factor - 1 = 2 of them), so S_U is not the binding limit, yet
small against the ~600 steps of an epoch.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.etcd.server import EmbeddedEtcd
from coordinator.launch import WorkerCommand
from tests.support.processes import Proc

console = Console(width=150)
REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "methods" / "fashion"  # the one-seed full-scale comparison
FASHION = "/usr/share/datasets/fashion-mnist"

#: name -> the barrier parameters of the `mnist` job
METHODS: dict[str, dict[str, str]] = {
    "bsp": {"method": "bsp"},
    "ssp": {"method": "ssp", "staleness": "3"},
    "asp": {"method": "asp"},
    "pbsp": {"method": "pbsp", "sample": "1"},
    "pssp": {"method": "pssp", "staleness": "3", "sample": "1"},
    "dssp": {"method": "dssp", "staleness": "3", "staleness_upper": "12"},
}
LABELS = {
    "bsp": "BSP",
    "ssp": "SSP (s=3)",
    "asp": "ASP",
    "pbsp": "pBSP (β=1)",
    "pssp": "pSSP (s=3, β=1)",
    "dssp": "DSSP (S_L=3, S_U=12)",
}
COLORS = {
    "bsp": "tab:blue",
    "ssp": "tab:orange",
    "asp": "tab:green",
    "pbsp": "tab:purple",
    "pssp": "tab:brown",
    "dssp": "tab:red",
}


@dataclass(frozen=True)
class Run:
    method: str
    straggler: bool

    @property
    def setting(self) -> str:
        return "straggler" if self.straggler else "uniform"


def run_one(
    endpoint: str,
    artifacts: Path,
    run: Run,
    params: dict[str, str],
    world_size: int,
    progress: Progress,
    task: Any,
) -> dict[str, Any]:
    """One job as `world_size` worker processes; its summary.json (rank 0's)."""
    job = f"methods-{run.method}-{run.setting}-{uuid.uuid4().hex[:6]}"
    args = WorkerCommand(
        job_id=job, world_size=world_size, etcd=endpoint, kind="mnist", timeout=600,
        params={k: str(v) for k, v in params.items()},
    ).process_argv()  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [Proc(args, env=env, cwd=REPO) for _ in range(world_size)]
    handled = [0] * len(procs)  # each member's events handled so far
    clocks: dict[int, tuple[int, int]] = {}
    accuracy = 0.0
    loads: list[float] = []
    sampled = time.monotonic()
    try:
        while True:
            fresh: list[dict[str, Any]] = []
            for index, proc in enumerate(procs):
                new = proc.events[handled[index] :]
                handled[index] += len(new)
                fresh += new
            if not fresh:
                if all(proc.exited_at is not None for proc in procs):  # output read to the end
                    break
                time.sleep(0.2)
            if time.monotonic() - sampled >= 2.0:
                sampled = time.monotonic()
                loads.append(os.getloadavg()[0])
            for event in fresh:
                if event.get("event") == "step":
                    clocks[event["rank"]] = (event["clock"], event["target"])
                elif event.get("event") == "metrics":
                    accuracy = event["accuracy"]
            if clocks:
                done = sum(c for c, _ in clocks.values())
                total = sum(t for _, t in clocks.values())
                progress.update(
                    task,
                    completed=done,
                    total=total,
                    description=f"{LABELS[run.method]}, {run.setting}: acc {accuracy:.3f}",
                )
    finally:
        for proc in procs:
            if proc.process.poll() is None:
                proc.process.terminate()
        for proc in procs:
            try:
                proc.process.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    for proc in procs:
        proc.finish(5)
        if proc.process.returncode != 0:
            code = proc.process.returncode
            raise RuntimeError(f"{run}: a member exited {code}: " + "\n".join(proc.stderr[-30:]))
    summary = json.loads((artifacts / job / "summary.json").read_text())
    summary["load_average"] = round(sum(loads) / len(loads), 2) if loads else None
    return summary


def time_to(metrics: list[dict[str, Any]], threshold: float) -> float | None:
    for record in metrics:
        if record["accuracy"] >= threshold:
            return float(record["t"])
    return None


def staleness_stats(histogram: dict[str, int]) -> tuple[float, int]:
    counts = {int(k): v for k, v in histogram.items() if v}
    total = sum(counts.values())
    if not total:
        return 0.0, 0
    return sum(k * v for k, v in counts.items()) / total, max(counts)


def rows_of(results: list[dict[str, Any]], thresholds: list[float]) -> list[dict[str, str]]:
    rows = []
    for r in results:
        summary = r["summary"]
        mean, high = staleness_stats(summary["staleness_histogram"])
        row = {"method": LABELS[r["method"]], "straggler": r["setting"]}
        for threshold in thresholds:
            seconds = time_to(summary["metrics"], threshold)
            row[f"s to {threshold:.2f}"] = "never" if seconds is None else f"{seconds:.1f}"
        row |= {
            "final acc": f"{summary['test_accuracy']:.4f}",
            "train s": f"{summary['seconds']:.1f}",
            "samples/s": f"{summary['samples_per_second']:.0f}",
            "mean staleness": f"{mean:.2f}",
            "max staleness": str(high),
        }
        if summary.get("load_average") is not None:
            row["load avg"] = f"{summary['load_average']:.1f}"
        rows.append(row)
    return rows


def write_tables(out: Path, rows: list[dict[str, str]]) -> None:
    with (out / "methods.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    columns = list(rows[0])
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join(":---" if c in ("method", "straggler") else "---:" for c in columns) + "|",
    ]
    lines += ["| " + " | ".join(row[c] for c in columns) + " |" for row in rows]
    (out / "methods.md").write_text("\n".join(lines) + "\n")


def plot(
    out: Path,
    results: list[dict[str, Any]],
    thresholds: list[float],
    title: str,
    factor: float,
    straggler_rank: int,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s for s in ("uniform", "straggler") if any(r["setting"] == s for r in results)]
    fig, axes = plt.subplots(
        2, len(settings), figsize=(7 * len(settings), 9.5), sharey=True, squeeze=False
    )
    accuracies = [m["accuracy"] for r in results for m in r["summary"]["metrics"]]
    useful = [a for a in accuracies if a > 0.15] or accuracies  # not a diverged run's 0.1
    low = max(0.0, min(min(thresholds) - 0.15, sorted(useful)[len(useful) // 10]))
    high = min(1.0, max(max(accuracies), max(thresholds)) + 0.02)
    for column, setting in enumerate(settings):
        for row, (key, scale) in enumerate((("t", 1.0), ("samples", 1e-3))):
            ax = axes[row][column]
            for r in results:
                if r["setting"] != setting:
                    continue
                metrics = r["summary"]["metrics"]
                best = max(m["accuracy"] for m in metrics)
                off = f" (never above {best:.2f}: off the axis)" if best < low else ""
                ax.plot(
                    [m[key] * scale for m in metrics],
                    [m["accuracy"] for m in metrics],
                    label=LABELS[r["method"]] + off,
                    color=COLORS[r["method"]],
                    linewidth=1.6,
                    marker=".",
                    markersize=5,
                )
            for threshold in thresholds:
                ax.axhline(threshold, color="grey", linestyle=":", linewidth=0.9)
                ax.annotate(
                    f"{threshold:.2f}",
                    (1.0, threshold),
                    xycoords=("axes fraction", "data"),
                    xytext=(3, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=8,
                    color="grey",
                )
            ax.set_ylim(low, high)
            ax.set_xlim(left=0)
            ax.grid(alpha=0.3)
            ax.set_xlabel(
                "wall time since the start of training (s)"
                if key == "t"
                else "samples trained, all trainers (thousands; at evaluation)"
            )
            what = "against wall time" if key == "t" else "against samples trained"
            ax.set_title(
                f"{what}: all trainers at full speed"
                if setting == "uniform"
                else f"{what}: rank {straggler_rank} a {factor:g}x straggler (sleeps)"
            )
        axes[0][column].set_ylabel("test accuracy")
        axes[1][column].set_ylabel("test accuracy")
    for ax in axes[0]:
        ax.legend(loc="lower right", fontsize=9)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "methods.png", dpi=110)
    plt.close(fig)


def main(
    data: str = typer.Option(FASHION, help="digits, or a directory of MNIST IDX files"),
    trainers: int = typer.Option(3, help="trainers (plus one parameter server)"),
    epochs: int = typer.Option(1, help="passes over each trainer's shard"),
    batch_size: int = typer.Option(32, help="samples per trainer step"),
    eval_seconds: float = typer.Option(3.0, help="seconds between test-set evaluations"),
    methods: str = typer.Option(",".join(METHODS), help="comma-separated subset"),
    straggler: str = typer.Option("both", help="off, on or both"),
    straggler_factor: float = typer.Option(3.0, help="the straggler's slowdown"),
    thresholds: str = typer.Option(
        "",
        help="accuracies to time, comma-separated (default: 0.75,0.80,0.84; digits: "
        "0.90,0.94,0.96)",
    ),
    seed: int = typer.Option(0, help="model initialisation and data order"),
    out: Path = typer.Option(OUT, help="output folder"),  # noqa: B008
    replot: bool = typer.Option(False, help="only redo tables and plot from --out's runs.json"),
) -> None:
    if replot:
        report(out, json.loads((out / "runs.json").read_text()))
        return
    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        raise typer.BadParameter(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    if straggler not in ("off", "on", "both"):
        raise typer.BadParameter("--straggler is off, on or both")
    levels = {"off": [False], "on": [True], "both": [False, True]}[straggler]
    if not thresholds:
        thresholds = "0.90,0.94,0.96" if data == "digits" else "0.75,0.80,0.84"
    marks = sorted(float(t) for t in thresholds.split(","))
    world_size = trainers + 1
    straggler_rank = world_size - 1  # ps=1: rank 0 is the server, 1..trainers train
    out.mkdir(parents=True, exist_ok=True)
    runs = [Run(m, s) for s in levels for m in names]
    base = {
        "data": data, "ps": "1", "epochs": str(epochs), "batch_size": str(batch_size),
        "eval_seconds": str(eval_seconds), "seed": str(seed), "threads": "1",
        "checkpoint_every": "0",
    }  # fmt: skip
    console.print(
        f"data {data}, 1 server + {trainers} trainers, {epochs} epochs, batch {batch_size}, "
        f"eval every {eval_seconds:g} s, {len(runs)} runs, thresholds {marks}"
    )
    results: list[dict[str, Any]] = []
    record: dict[str, Any] = {}
    began = time.perf_counter()
    with (
        EmbeddedEtcd() as server,
        tempfile.TemporaryDirectory(prefix="bench-methods-") as tmp,
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            console=console,
        ) as progress,
    ):
        server.security.export()  # members and clients log in as root (auth is on)
        overall = progress.add_task("runs", total=len(runs))
        for run in runs:
            params = {**base, **METHODS[run.method], "artifacts": tmp}
            if run.straggler:
                params |= {
                    "straggler_rank": str(straggler_rank),
                    "straggler_factor": f"{straggler_factor:g}",
                }
            task = progress.add_task(f"{LABELS[run.method]}, {run.setting}", total=None)
            summary = run_one(server.endpoint, Path(tmp), run, params, world_size, progress, task)
            progress.remove_task(task)
            summary.pop("model_path", None)
            results.append({"method": run.method, "setting": run.setting, "summary": summary})
            progress.console.print(
                f"{LABELS[run.method]:>22}, {run.setting:>9}: accuracy "
                f"{summary['test_accuracy']:.4f} after {summary['seconds']:.1f} s, "
                f"{summary['samples_per_second']:.0f} samples/s"
            )
            progress.advance(overall)
            record = {
                "params": base, "trainers": trainers, "straggler_rank": straggler_rank,
                "straggler_factor": straggler_factor, "thresholds": marks,
                "elapsed_seconds": round(time.perf_counter() - began, 1), "runs": results,
            }  # fmt: skip
            # after every run: a run cut short still leaves what it measured
            (out / "runs.json").write_text(json.dumps(record, indent=1))
    report(out, record)


def report(out: Path, record: dict[str, Any]) -> None:
    """Tables and plot from a runs.json record (what a run writes)."""
    params, results, marks = record["params"], record["runs"], record["thresholds"]
    rows = rows_of(results, marks)
    write_tables(out, rows)
    data = params["data"]
    name = "Fashion-MNIST" if "fashion" in data.lower() else data
    epochs = params["epochs"]
    plot(
        out,
        results,
        marks,
        f"Test accuracy: {name}, 1 server + {record['trainers']} trainers,\n"
        f"{epochs} epoch{'s' if epochs != '1' else ''}, batch {params['batch_size']}, "
        f"evaluation every {float(params['eval_seconds']):g} s + its own duration",
        record["straggler_factor"],
        record["straggler_rank"],
    )
    elapsed = record.get("elapsed_seconds")
    table = Table(
        title="time to accuracy" + (f" ({elapsed / 60:.1f} min in all)" if elapsed else "")
    )
    for column in rows[0]:
        table.add_column(column, justify="left" if column in ("method", "straggler") else "right")
    for row in rows:
        table.add_row(*row.values())
    console.print(table)
    console.print(f"wrote {out / 'methods.csv'}, {out / 'methods.md'}, {out / 'methods.png'}")


if __name__ == "__main__":
    typer.run(main)
