"""`coordinator simulate --train mnist`: the real model trained in virtual time.

Every option is checked before anything trains; a bad one exits 2 naming it.
PyTorch is the `mnist` extra, imported only here, after the checks that need
no torch.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import MofNCompleteColumn, TextColumn

from coordinator.cli.options import console, folding_table, progress_bar

MODELS = ("mnist",)
MNIST_EXTRA = "pip install 'etcd-coordinator[mnist]'"
AGGREGATE = "bsp-agg"


@dataclass(frozen=True)
class Options:
    model: str
    workers: int
    barrier: str
    staleness: int | None
    sample: int | None
    staleness_upper: int | None
    delay: str
    seed: int
    sample_timing: str
    out: str
    seeds: int
    targets: str
    batch_size: int | None
    epochs: float | None
    virtual_seconds: float | None
    data: str
    test_rows: int | None
    eval_seconds: float | None
    lr: float
    momentum: float
    lr_decay: float
    update_rule: str | None
    compensation: float
    latency: float
    bandwidth: float


def parse_targets(text: str) -> list[float]:
    """`0.8,0.9` -> [0.8, 0.9]; each in (0, 1]."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{part!r} is not a number") from None
        if not 0 < value <= 1:
            raise ValueError(f"target {part} must be in (0, 1] (a test accuracy)")
        values.append(value)
    return values


def _bad(message: str, option: str) -> typer.BadParameter:
    return typer.BadParameter(message, param_hint=option)


def run(options: Options) -> None:
    from coordinator.barriers.arguments import barrier_list
    from coordinator.barriers.policy import BarrierSpec, Method, SampleTiming
    from coordinator.simulator.delays import parse_delay

    if options.model.strip().lower() not in MODELS:
        raise _bad(
            f"{options.model!r}: the model to train must be one of {', '.join(MODELS)}", "--train"
        )
    # bsp-agg is BSP with aggregation: parsed apart from the barrier list's grammar.
    items = [item.strip() for item in options.barrier.split(",")]
    plain = [item for item in items if item.lower() != AGGREGATE]
    try:
        parsed = iter(barrier_list(",".join(plain), options.staleness, options.sample,
                                     options.staleness_upper) if plain else [])  # fmt: skip
    except ValueError as exc:
        raise _bad(str(exc), "--barrier") from None
    specs: list[tuple[BarrierSpec, bool]] = [
        (BarrierSpec(Method.BSP), True) if item.lower() == AGGREGATE else (next(parsed), False)
        for item in items
    ]
    try:
        delay = parse_delay(options.delay)
    except ValueError as exc:
        raise _bad(str(exc), "--delay") from None
    try:
        timing = SampleTiming(options.sample_timing)
    except ValueError:
        raise _bad(
            f"{options.sample_timing!r}: use per-check or per-step", "--sample-timing"
        ) from None
    try:
        targets = parse_targets(options.targets)
    except ValueError as exc:
        raise _bad(str(exc), "--targets") from None
    for name, value, ok in (
        ("--epochs", options.epochs, lambda v: v > 0 and math.isfinite(v)),
        ("--virtual-seconds", options.virtual_seconds, lambda v: v > 0 and math.isfinite(v)),
        ("--eval-seconds", options.eval_seconds, lambda v: v > 0 and math.isfinite(v)),
        ("--lr", options.lr, lambda v: v > 0 and math.isfinite(v)),
        ("--momentum", options.momentum, lambda v: 0 <= v < 1),
        ("--lr-decay", options.lr_decay, lambda v: 0 < v <= 1),
        ("--latency", options.latency, lambda v: v >= 0 and math.isfinite(v)),
        ("--bandwidth", options.bandwidth, lambda v: v > 0),
    ):
        if value is not None and not ok(value):
            raise _bad(f"{value:g} is out of range", name)
    from coordinator.ps.rules import check_rule, default_batch

    try:
        checked = check_rule(options.update_rule or "plain", options.compensation)
        rule = checked if options.update_rule else None  # None: each method's default
    except ValueError as exc:
        option = "--compensation" if str(exc).startswith("compensation") else "--update-rule"
        raise _bad(str(exc), option) from None
    try:
        from coordinator.simulator import train_report, training
        from coordinator.simulator.training_data import TrainingData
        from coordinator.simulator.training_results import label
    except ImportError as exc:
        raise _bad(
            f"training needs PyTorch ({exc.name} is missing): {MNIST_EXTRA}", "--train"
        ) from None
    from coordinator.datasets.mnist import parse_mnist
    from coordinator.ps.optim import OptimizerSpec

    try:
        source = parse_mnist(options.data, field="--data")
        data = TrainingData.load(source, options.workers, options.test_rows)
    except ValueError as exc:
        raise _bad(str(exc), "--data") from None
    batch = options.batch_size or default_batch(options.workers)
    epochs = options.epochs
    if epochs is None and options.virtual_seconds is None:
        epochs = 1.0
    transfer = training.Transfer(options.latency, options.bandwidth)
    eval_seconds = options.eval_seconds or training.default_eval_seconds(
        delay, data, batch, epochs, options.virtual_seconds, transfer
    )

    def optimizer(aggregate: bool) -> OptimizerSpec:
        every = training.updates_per_epoch(data, batch, aggregate)
        return OptimizerSpec(
            "sgd", options.lr, options.momentum, decay=options.lr_decay, decay_every=every
        )

    seeds = range(options.seed, options.seed + options.seeds)
    directory = pathlib.Path(options.out)
    directory.mkdir(parents=True, exist_ok=True)
    runs = []
    plan = training.runs_for(specs, seeds)
    runs_done = (MofNCompleteColumn(), TextColumn("runs (method x seed)"))
    with progress_bar(*runs_done, transient=True) as bar:
        task = bar.add_task("training", total=len(plan))
        for spec, aggregate, seed in plan:
            name = label(spec, aggregate, timing)
            bar.update(task, description=f"{name} seed {seed}")
            runs.append(
                training.train(
                    spec, data, batch_size=batch, epochs=epochs,
                    virtual_seconds=options.virtual_seconds, delay=delay, seed=seed,
                    optimizer=optimizer(aggregate), rule=rule,
                    aggregate=aggregate, eval_seconds=eval_seconds,
                    transfer=transfer, timing=timing,
                )
            )  # fmt: skip
            bar.advance(task)
    written = train_report.write_csvs(runs, targets, directory)
    bound = (
        f"{epochs:g} epoch(s)" if epochs is not None else f"{options.virtual_seconds:g} virtual s"
    )
    title = f"{options.model}, P={options.workers}, batch {batch}, {bound}, delay {options.delay}"
    try:
        written += train_report.plot(runs, targets, directory, title=title)
        no_plot = None
    except train_report.PlotUnavailable as exc:
        no_plot = str(exc)
    rows = train_report.summary(runs, targets)
    headers = tuple(rows[0])
    table = folding_table(
        *headers, title=f"{title}, seeds {seeds.start}..{seeds.stop - 1}", right=headers[1:]
    )
    for row in rows:
        table.add_row(*row.values())
    Console().print(table)
    names = ", ".join(str(path) for path in written)
    if no_plot is None:
        console.print(f"wrote {names}")
    else:  # escaped: the extra's name is in brackets, which rich would take for markup
        console.print(f"wrote {names}; no plots: {escape(no_plot)}")
