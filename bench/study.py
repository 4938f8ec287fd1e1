"""The methods study in virtual time: the DSSP and PSP claims, many seeds, 95 % CIs.

Every number comes from the simulator (`coordinator.simulator`): the real `MnistNet`
trained in virtual time (`training.train`, what `coordinator simulate --train mnist`
runs) and the step engine (`engine.simulate`, `coordinator simulate` without --train).
Results are deterministic; only the wall time depends on the machine.

    python bench/study.py                    # every table of docs/methods/study.md (~25 min)
    python bench/study.py --part dssp        # one table group
    python bench/study.py --seeds 3 --jobs 1 # fewer seeds, one process

With no --part, the commands of `STUDY` run one after another: each writes the
tables study.md shows, with the same settings.

Parts:
- check: the live job's optimizer (lr 0.02, momentum 0.9) at P=4, seed 0: if a
  one-by-one method ends below --diverged accuracy, the study uses --lr/--momentum
  (0.05/0.5, as docs/simulator.md does) instead; the table says which.
- dssp: DSSP's setting scaled: P=2 (straggler:0.5,3), P=4 and P=16 (straggler:0.25,3);
  bsp, ssp:3, asp, pbsp:1, pssp:3:1, dssp:3:12, bsp-agg; time to the targets.
- steps: PSP's step rate at P=64 (step engine, no training): bsp, ssp:4, pbsp:B,
  pssp:4:B for B in --betas; steps per virtual second, spread (largest clock gap), wait.
- psp: the same methods at P=64 with training: time to the targets.

Writes markdown and CSV tables (and PNG plots) under --out, and study.json (the
settings, commands and wall times).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.barriers.arguments import barrier_list  # noqa: E402
from coordinator.barriers.policy import BarrierSpec, Method  # noqa: E402
from coordinator.simulator import train_report  # noqa: E402
from coordinator.simulator.delays import parse_delay  # noqa: E402
from coordinator.simulator.engine import simulate  # noqa: E402

console = Console(width=170)
DSSP_METHODS = "bsp,ssp:3,asp,pbsp:1,pssp:3:1,dssp:3:12,bsp-agg"
DSSP_SETTINGS = [(2, "straggler:0.5,3"), (4, "straggler:0.25,3"), (16, "straggler:0.25,3")]
PSP_WORKERS = 64
PSP_DELAY = "straggler:0.25,3"
LIVE = (0.02, 0.9)
#: The whole study: one command per table group of docs/methods/study.md. The check's
#: optimizer (lr 0.05, momentum 0.5: the live one diverges) is too large a step at P=16 and
#: P=64, so those also run with smaller steps.
SMALL_STEP = ["--force-optimizer", "--momentum", "0", "--targets", "0.6,0.7,0.8"]
STUDY = [
    ["--part", "dssp"],  # the check, then P=2, 4, 16
    ["--part", "steps"],
    ["--part", "dssp", "--dssp-workers", "16", *SMALL_STEP, "--lr", "0.01", "--epochs", "4",
     "--tag", "_lr0.01"],
    ["--part", "psp", *SMALL_STEP, "--lr", "0.01", "--psp-epochs", "4", "--tag", "_lr0.01"],
    ["--part", "psp", *SMALL_STEP, "--lr", "0.003", "--psp-epochs", "4", "--tag", "_lr0.003"],
]  # fmt: skip


def specs_of(text: str) -> list[tuple[BarrierSpec, bool]]:
    out = []
    for item in text.split(","):
        if item == "bsp-agg":
            out.append((BarrierSpec(Method.BSP), True))
        else:
            out.append((barrier_list(item)[0], False))
    return out


def psp_methods(betas: list[int]) -> str:
    return ",".join(
        ["bsp", "ssp:4"] + [f"pbsp:{b}" for b in betas] + [f"pssp:4:{b}" for b in betas]
    )


# Training runs, in worker processes ------------------------------------------------------

_DATA: dict[tuple[int, int | None], object] = {}


def _train(job: dict) -> object:
    from coordinator.datasets.mnist import parse_mnist
    from coordinator.ps.optim import OptimizerSpec
    from coordinator.ps.rules import UpdateRule
    from coordinator.simulator import training
    from coordinator.simulator.training_data import TrainingData

    key = (job["workers"], job["test_rows"])
    if key not in _DATA:
        _DATA[key] = TrainingData.load(parse_mnist(job["data"]), *key)
    data = _DATA[key]
    spec, aggregate = specs_of(job["method"])[0]
    run = training.train(
        spec,
        data,
        batch_size=job["batch"],
        epochs=job["epochs"],
        delay=parse_delay(job["delay"]),
        seed=job["seed"],
        optimizer=OptimizerSpec("sgd", job["lr"], job["momentum"]),
        rule=UpdateRule("plain"),  # the papers' updates: as given (update_rules.py: fair ones)
        aggregate=aggregate,
        eval_seconds=job["eval_seconds"],
        stop_accuracy=job["stop"],
    )
    run.weights = None  # not needed here; keeps the result small
    return run


def eval_grid(workers: int, delay: str, data: str, batch: int, epochs: float, points: int):
    from coordinator.datasets.mnist import parse_mnist
    from coordinator.simulator import training
    from coordinator.simulator.training_data import TrainingData

    loaded = TrainingData.load(parse_mnist(data), workers, 1)
    return training.default_eval_seconds(
        parse_delay(delay), loaded, batch, epochs, None, points=points
    )


def train_many(jobs: list[dict], processes: int) -> list:
    if processes <= 1:
        return [_train(job) for job in jobs]
    with ProcessPoolExecutor(processes) as pool:
        return list(pool.map(_train, jobs))


# Tables -------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def train_table(runs: list, targets: list[float]) -> tuple[list[str], list[list[str]]]:
    header = ["method", "last acc", "virtual s", "updates", "mean stale"]
    header += [f"t({t:g}) s [95 % CI] reached" for t in targets]
    rows = []
    ttas = train_report.time_to_accuracy(runs, targets)
    for method in train_report.methods(runs):
        mine = [r for r in runs if r.label == method]
        grads = sum(sum(r.staleness.values()) for r in mine)
        stale = sum(k * v for r in mine for k, v in r.staleness.items())
        row = [
            method,
            f"{statistics.fmean(r.evaluations[-1].accuracy for r in mine):.3f}",
            f"{statistics.fmean(r.virtual_seconds for r in mine):.1f}",
            f"{statistics.fmean(r.updates for r in mine):.0f}",
            f"{stale / grads:.2f}" if grads else "-",
        ]
        for tta in ttas:
            if tta.method != method:
                continue
            if tta.mean is None:
                row.append(f"never (0/{tta.seeds})")
            elif tta.low is None:
                row.append(f"{tta.mean:.1f} ({tta.reached}/{tta.seeds})")
            else:
                row.append(
                    f"{tta.mean:.1f} [{tta.low:.1f}, {tta.high:.1f}] ({tta.reached}/{tta.seeds})"
                )
        rows.append(row)
    return header, rows


def emit(name: str, title: str, header: list[str], rows: list[list[str]], out: Path) -> None:
    table = Table(title=title)
    for column in header:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    with (out / f"{name}.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def ratios(runs: list, targets: list[float], subject: str, others: list[str]) -> dict:
    """Mean time of `subject` over each other's, per target (only where both reached it)."""
    ttas = {(t.method, t.target): t for t in train_report.time_to_accuracy(runs, targets)}
    out: dict[str, dict[str, float | None]] = {}
    for target in targets:
        mine = ttas.get((subject, target))
        out[f"{target:g}"] = {}
        for other in others:
            theirs = ttas.get((other, target))
            ok = mine and theirs and mine.mean and theirs.mean
            out[f"{target:g}"][other] = round(theirs.mean / mine.mean, 3) if ok else None
    return out


# Parts ---------------------------------------------------------------------------------------


def train_setting(args, workers, delay, methods, seeds, epochs, lr, momentum) -> list:
    step = eval_grid(workers, delay, args.data, args.batch, epochs, args.points)
    jobs = [
        {
            "workers": workers,
            "delay": delay,
            "method": method,
            "seed": seed,
            "data": args.data,
            "test_rows": args.test_rows,
            "batch": args.batch,
            "epochs": epochs,
            "lr": lr,
            "momentum": momentum,
            "eval_seconds": step,
            "stop": max(args.targets),
        }
        for method in methods.split(",")
        for seed in range(seeds)
    ]
    return train_many(jobs, args.jobs)


def part_check(args, out: Path, record: dict) -> tuple[float, float]:
    lr, momentum = LIVE
    runs = train_setting(args, 4, "straggler:0.25,3", "asp,ssp:3,bsp-agg", 1, args.epochs, lr,
                         momentum)  # fmt: skip
    header, rows = train_table(runs, args.targets)
    title = f"check: live optimizer (lr {lr}, momentum {momentum}), P=4, straggler:0.25,3, seed 0"
    emit("check", title, header, rows, out)
    one_by_one = [r for r in runs if not r.label.endswith("-agg")]
    diverged = [r.label for r in one_by_one if r.evaluations[-1].accuracy < args.diverged]
    choice = (args.lr, args.momentum) if diverged else LIVE
    record["check"] = {"diverged": diverged, "lr": choice[0], "momentum": choice[1]}
    console.print(f"diverged with the live optimizer: {diverged or 'none'}; using lr {choice}")
    return choice


def part_dssp(args, out: Path, record: dict, lr: float, momentum: float) -> None:
    record["dssp"] = {}
    for workers, delay in DSSP_SETTINGS:
        if workers not in args.dssp_workers:
            continue
        began = time.monotonic()
        runs = train_setting(args, workers, delay, args.dssp_methods, args.seeds, args.epochs,
                             lr, momentum)  # fmt: skip
        header, rows = train_table(runs, args.targets)
        title = (
            f"DSSP setting: P={workers}, {delay}, digits, batch {args.batch}, "
            f"{args.epochs:g} epochs, lr {lr}, momentum {momentum}, seeds 0..{args.seeds - 1}"
        )
        name = f"dssp_p{workers}{args.tag}"
        emit(name, title, header, rows, out)
        sub = out / name
        sub.mkdir(exist_ok=True)
        train_report.write_csvs(runs, args.targets, sub)
        (sub / "accuracy.csv").unlink()  # the curves are in the plot; keep the folder small
        try:
            train_report.plot(runs, args.targets, sub, title=f"P={workers}, {delay}")
        except train_report.PlotUnavailable as exc:
            console.print(str(exc))
        record["dssp"][name] = {
            "wall_seconds": round(time.monotonic() - began, 1),
            "dssp_speedup_over": ratios(
                runs, args.targets, "dssp(S_L=3, S_U=12)", ["bsp", "ssp(s=3)", "asp", "bsp-agg"]
            ),
        }


def part_steps(args, out: Path, record: dict) -> None:
    began = time.monotonic()
    header = ["method", "delay", "steps / virtual s", "[95 % CI]", "largest clock gap", "wait %"]
    rows = []
    for delay_text in ("exp:1,1", PSP_DELAY):
        delay = parse_delay(delay_text)
        for item in ["asp", *psp_methods(args.betas).split(",")]:
            spec = barrier_list(item)[0]
            rates, gaps, waits = [], [], []
            for seed in range(args.step_seeds):
                result = simulate(spec, PSP_WORKERS, args.step_seconds, delay, seed)
                rates.append(sum(result.final_step) / result.seconds)
                gaps.append(result.largest_gap)
                waits.append(result.mean_wait / result.seconds)
            mean, half = train_report.mean_interval(rates)
            half = half or 0.0
            rows.append(
                [str(spec), delay_text, f"{mean:.2f}", f"[{mean - half:.2f}, {mean + half:.2f}]",
                 f"{statistics.fmean(gaps):.1f}", f"{100 * statistics.fmean(waits):.1f}"]
            )  # fmt: skip
    title = (
        f"PSP step rate: P={PSP_WORKERS}, {args.step_seconds:g} virtual s, "
        f"seeds 0..{args.step_seeds - 1} (all workers' steps per virtual second)"
    )
    emit("psp_steps", title, header, rows, out)
    record["steps"] = {"wall_seconds": round(time.monotonic() - began, 1)}


def part_psp(args, out: Path, record: dict, lr: float, momentum: float) -> None:
    began = time.monotonic()
    runs = train_setting(args, PSP_WORKERS, PSP_DELAY, psp_methods(args.betas), args.psp_seeds,
                         args.psp_epochs, lr, momentum)  # fmt: skip
    header, rows = train_table(runs, args.targets)
    title = (
        f"PSP setting: P={PSP_WORKERS}, {PSP_DELAY}, digits, batch {args.batch}, "
        f"{args.psp_epochs:g} epochs, lr {lr}, momentum {momentum}, seeds 0..{args.psp_seeds - 1}"
    )
    emit(f"psp_train{args.tag}", title, header, rows, out)
    sub = out / f"psp_train{args.tag}"
    sub.mkdir(exist_ok=True)
    train_report.write_csvs(runs, args.targets, sub)
    (sub / "accuracy.csv").unlink()
    record["psp"] = {"wall_seconds": round(time.monotonic() - began, 1)}


def main(argv: list[str]) -> None:
    if not any(a == "--part" or a.startswith("--part=") for a in argv):
        for command in STUDY:
            console.rule("python bench/study.py " + " ".join([*command, *argv]))
            main([*command, *argv])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", required=True, choices=["check", "dssp", "steps", "psp"])
    parser.add_argument("--out", type=Path, default=ROOT / "docs/methods/study")
    parser.add_argument("--seeds", type=int, default=5, help="seeds of the DSSP tables")
    parser.add_argument("--psp-seeds", type=int, default=3)
    parser.add_argument("--step-seeds", type=int, default=5)
    parser.add_argument("--step-seconds", type=float, default=200.0)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--psp-epochs", type=float, default=2.0)
    parser.add_argument("--betas", type=lambda s: [int(b) for b in s.split(",")],
                        default=[1, 2, 4, 8, 16])  # fmt: skip
    parser.add_argument("--targets", type=lambda s: [float(t) for t in s.split(",")],
                        default=[0.8, 0.85, 0.9])  # fmt: skip
    parser.add_argument("--dssp-methods", default=DSSP_METHODS)
    parser.add_argument("--data", default="digits")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--test-rows", type=int, default=500)
    parser.add_argument("--points", type=int, default=40, help="evaluations over an ASP epoch")
    parser.add_argument("--lr", type=float, default=0.05, help="fallback if the live one diverges")
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--diverged", type=float, default=0.5, help="last accuracy below: diverged")
    parser.add_argument(
        "--dssp-workers",
        type=lambda s: [int(p) for p in s.split(",")],
        default=[2, 4, 16],
        help="which of the DSSP settings (P) to run",
    )
    parser.add_argument(
        "--force-optimizer", action="store_true", help="skip the check: train with --lr/--momentum"
    )
    parser.add_argument("--tag", default="", help="suffix of the output names")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record: dict = {"command": " ".join(["python bench/study.py", *argv])}
    record["settings"] = {k: str(v) for k, v in vars(args).items() if k != "out"}
    began = time.monotonic()
    lr, momentum = args.lr, args.momentum
    if args.force_optimizer:
        record["check"] = {"forced": True, "lr": lr, "momentum": momentum}
    elif args.part in ("check", "dssp", "psp"):
        t = time.monotonic()
        lr, momentum = part_check(args, args.out, record)
        record["check"]["wall_seconds"] = round(time.monotonic() - t, 1)
    if args.part == "dssp":
        part_dssp(args, args.out, record, lr, momentum)
    if args.part == "steps":
        part_steps(args, args.out, record)
    if args.part == "psp":
        part_psp(args, args.out, record, lr, momentum)
    record["wall_seconds"] = round(time.monotonic() - began, 1)
    console.print(f"wall time {record['wall_seconds']:.1f} s")
    (args.out / f"study-{args.part}{args.tag}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
