"""The `simulate` command: many virtual workers under barrier methods, without etcd."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import TextColumn

from coordinator.cli.options import console, folding_table, progress_bar


def simulate_barriers(
    workers: Annotated[int, typer.Option(min=1, help="number of virtual workers P")] = 200,
    seconds: Annotated[float, typer.Option(min=0, help="simulated duration in seconds")] = 200.0,
    barrier: Annotated[
        str,
        typer.Option(
            help="method(s), comma-separated: bsp, asp, ssp[:S], pbsp[:BETA], pssp[:S:BETA], "
            "dssp[:S_L:S_U]; bare names take --staleness/--sample/--staleness-upper"
        ),
    ] = "pssp",
    staleness: Annotated[
        int | None, typer.Option(min=0, help="s for ssp/pssp, S_L for dssp", show_default=False)
    ] = None,
    sample: Annotated[
        int | None, typer.Option(min=0, help="beta for pbsp/pssp", show_default=False)
    ] = None,
    staleness_upper: Annotated[
        int | None, typer.Option(min=0, help="S_U for dssp", show_default=False)
    ] = None,
    delay: Annotated[
        str,
        typer.Option(
            help="step durations: exp:SHIFT,MEAN | gamma:SHAPE,SCALE | "
            "straggler:FRACTION,FACTOR[,BASE] | trace:CSV"
        ),
    ] = "exp:1,1",
    seed: Annotated[int, typer.Option(help="seed of the delay and sampling streams")] = 0,
    sample_timing: Annotated[
        str, typer.Option(help="per-check (fresh sample at each check) or per-step (one per wait)")
    ] = "per-check",
    out: Annotated[
        str,
        typer.Option(
            help="directory for steps.csv and steps.png (with --train: accuracy.csv, "
            "time_to_accuracy.csv, staleness.csv, accuracy.png, time_to_accuracy.png; the "
            "plots need the sim extra)"
        ),
    ] = ".",
    train: Annotated[
        str | None,
        typer.Option(
            help="train a real model in virtual time: mnist (the extra mnist); --barrier also "
            "takes bsp-agg (BSP, a step's gradients averaged into one update)",
            show_default=False,
        ),
    ] = None,
    seeds: Annotated[int, typer.Option(min=1, help="--train: runs per method (seeds seed..)")] = 3,
    targets: Annotated[
        str, typer.Option(help="--train: test accuracies for time_to_accuracy.csv, in (0, 1]")
    ] = "0.8,0.85,0.9",
    batch_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="--train: batch per trainer step (default 32 up to 8 workers, then 256/P, "
            "at least 8)",
            show_default=False,
        ),
    ] = None,
    epochs: Annotated[
        float | None,
        typer.Option(
            help="--train: stop after this many passes over the training set "
            "(default 1 unless --virtual-seconds)",
            show_default=False,
        ),
    ] = None,
    virtual_seconds: Annotated[
        float | None,
        typer.Option(help="--train: stop at this virtual time", show_default=False),
    ] = None,
    data: Annotated[
        str, typer.Option(help="--train: 'digits' (builtin 5,000) or a directory of IDX files")
    ] = "digits",
    eval_seconds: Annotated[
        float | None,
        typer.Option(
            help="--train: evaluate every this many virtual seconds "
            "(default: about 20 points over an ASP-paced run)",
            show_default=False,
        ),
    ] = None,
    test_rows: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="--train: evaluate on the first N test images (default: all)",
            show_default=False,
        ),
    ] = None,
    lr: Annotated[float, typer.Option(help="--train: SGD learning rate")] = 0.02,
    momentum: Annotated[float, typer.Option(help="--train: SGD momentum")] = 0.9,
    lr_decay: Annotated[
        float,
        typer.Option(
            help="--train: the lr is multiplied by this after each epoch's updates (the mnist "
            "job's default; 1: constant)"
        ),
    ] = 0.7,
    update_rule: Annotated[
        str | None,
        typer.Option(
            help="--train: how a gradient becomes a step: plain, scaled, async, staleness or "
            "dc (default: scaled for bsp-agg, async for the others; see "
            "docs/methods/update_rules.md)",
            show_default=False,
        ),
    ] = None,
    compensation: Annotated[
        float, typer.Option(help="--train: update rule dc's lambda, in [0, 10]")
    ] = 0.5,
    latency: Annotated[
        float, typer.Option(help="--train: one-way network latency per pull/push, seconds")
    ] = 0.0005,
    bandwidth: Annotated[
        float, typer.Option(help="--train: network bandwidth, bytes per second")
    ] = 1.25e9,
) -> None:
    """Simulate P workers under barrier methods; write DIR/steps.csv and DIR/steps.png (the
    plot needs the sim extra). With --train mnist, P trainers train the real model in virtual
    time (see docs/simulator.md)."""
    # Imported here: the simulator is not needed by the worker commands.
    import pathlib

    if train is not None:
        from coordinator.cli import simulate_training

        simulate_training.run(
            simulate_training.Options(
                model=train, workers=workers, barrier=barrier, staleness=staleness,
                sample=sample, staleness_upper=staleness_upper, delay=delay, seed=seed,
                sample_timing=sample_timing, out=out, seeds=seeds, targets=targets,
                batch_size=batch_size, epochs=epochs, virtual_seconds=virtual_seconds,
                data=data, test_rows=test_rows, eval_seconds=eval_seconds, lr=lr, momentum=momentum,
                lr_decay=lr_decay, update_rule=update_rule, compensation=compensation,
                latency=latency, bandwidth=bandwidth,
            )
        )  # fmt: skip
        return

    from coordinator.barriers.arguments import barrier_list
    from coordinator.barriers.policy import SampleTiming
    from coordinator.simulator import engine, report
    from coordinator.simulator.delays import parse_delay

    directory = pathlib.Path(out)

    try:
        specs = barrier_list(barrier, staleness, sample, staleness_upper)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--barrier") from None
    try:
        model = parse_delay(delay)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--delay") from None
    try:
        timing = SampleTiming(sample_timing)
    except ValueError:
        raise typer.BadParameter(
            f"{sample_timing!r}: use per-check or per-step", param_hint="--sample-timing"
        ) from None
    directory.mkdir(parents=True, exist_ok=True)
    results = []
    simulated = TextColumn("{task.completed:.0f}/{task.total:.0f} simulated s")
    with progress_bar(simulated, transient=True) as bar:
        for spec in specs:
            task = bar.add_task(str(spec), total=seconds or 1)
            results.append(
                engine.simulate(
                    spec,
                    workers,
                    seconds,
                    model,
                    seed=seed,
                    timing=timing,
                    progress=lambda t, task=task: bar.update(task, completed=t),
                )
            )
    csv_path, png_path = directory / "steps.csv", directory / "steps.png"
    report.write_csv(results, csv_path)
    try:
        report.plot(results, png_path, title=f"P={workers}, {seconds:g} s, delay {delay}")
        no_plot = None
    except report.PlotUnavailable as exc:  # a plain install: the numbers still count
        no_plot = str(exc)
    headers = ("method", "mean step", "min", "max", "mean wait (s)", "max gap")
    title = f"{workers} workers, {seconds:g} simulated s, delay {delay}, seed {seed}"
    table = folding_table(*headers, title=title, right=headers[1:])
    for result in results:
        row = report.summary(result)
        table.add_row(*(str(value) for value in row.values()))
    Console().print(table)
    if no_plot is None:
        console.print(f"wrote {csv_path} and {png_path}")
    else:  # escaped: the extra's name is in brackets, which rich would take for markup
        console.print(f"wrote {csv_path}; no plot: {escape(no_plot)}")
