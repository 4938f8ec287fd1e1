"""What `coordinator run` shows: its workers' progress while they run (a bar per phase,
or its programs' output), then their roster or their failures, and its exit code."""

from __future__ import annotations

import queue
import sys
import time
from collections.abc import Callable

from rich.markup import escape
from rich.progress import MofNCompleteColumn, Progress, TaskID

from coordinator.cli.options import console, folding_table, progress_bar
from coordinator.events import Metrics, Output, Phase, Report, Round, Step
from coordinator.launch.piped import PipedLauncher, PipedWorker
from coordinator.rendezvous.errors import MemberLost

#: The phases every worker passes, a bar each.
PHASES = ["leader_election", "ip_exchange", "connect", "training", "cleaner"]


def follow(launcher: PipedLauncher, deadline: float) -> None:
    """A bar per phase that every worker passes, and the training's progress, until the
    workers end or `deadline` (monotonic) passes."""
    n = len(launcher.workers)
    with progress_bar(MofNCompleteColumn(), description="{task.description:<16}") as progress:
        tasks = {phase: progress.add_task(phase, total=n) for phase in PHASES}
        clocks: dict[int, tuple[int, int]] = {}  # trainer rank -> (clock, target)
        while launcher.running() or not launcher.events.empty():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                console.print("[red]workers overran their deadline: stopping them[/red]")
                return
            try:
                _, event = launcher.events.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if isinstance(event, Phase) and event.phase in tasks:
                progress.advance(tasks[event.phase])
            elif isinstance(event, Round) and event.rank == 0:  # boosting rounds
                if "rounds" not in tasks:
                    tasks["rounds"] = progress.add_task("boosting rounds", total=event.rounds)
                metrics = "  ".join(f"{k} {v:.4f}" for k, v in event.metrics.items())
                progress.update(
                    tasks["rounds"], completed=event.round, description=f"round {metrics}"
                )
            elif isinstance(event, Step | Metrics):  # the mnist job's trainers and server
                _follow_steps(progress, tasks, event, clocks)


def echo(launcher: PipedLauncher) -> None:
    """Show the programs' output lines, each prefixed with its rank, as they come, and
    their reports as one bar: every rank's latest step of its total, and the latest
    metrics. Report lines are printed too where the output is not a terminal (a log)."""
    reports: dict[int, Report] = {}  # rank -> its latest report
    lines = not sys.stdout.isatty()
    with progress_bar(MofNCompleteColumn()) as progress:
        task: TaskID | None = None
        while launcher.running() or not launcher.events.empty():
            try:
                index, event = launcher.events.get(timeout=0.5)
            except queue.Empty:
                continue
            rank = launcher.workers[index].rank
            if isinstance(event, Output) or (isinstance(event, Report) and lines):
                stream = sys.stderr if getattr(event, "stream", "") == "stderr" else sys.stdout
                line = event.line if isinstance(event, Output) else event.to_line()
                who = f"rank {rank}" if rank is not None else f"worker {index}"
                print(f"[{who}] {line}", file=stream, flush=True)
            if isinstance(event, Report) and event.step is not None:
                reports[event.rank if event.rank is not None else -1] = event
                if task is None:
                    task = progress.add_task("steps", total=None)
                totals = [r.total for r in reports.values()]
                metrics = "  ".join(f"{k} {v:.4g}" for k, v in event.metrics.items())
                progress.update(
                    task,
                    completed=sum(r.step or 0 for r in reports.values()),
                    total=None if None in totals else sum(t or 0 for t in totals),
                    description=f"steps  {metrics}".strip(),
                )


def _follow_steps(
    progress: Progress,
    tasks: dict[str, TaskID],
    event: Step | Metrics,
    clocks: dict[int, tuple[int, int]],
) -> None:
    """One bar for all trainers' steps, titled with the latest test accuracy."""
    if "steps" not in tasks:
        tasks["steps"] = progress.add_task("training steps", total=None)
    if isinstance(event, Step):
        clocks[event.rank] = (event.clock, event.target)
        progress.update(
            tasks["steps"],
            completed=sum(clock for clock, _ in clocks.values()),
            total=sum(target for _, target in clocks.values()),
        )
    elif event.accuracy is not None:
        progress.update(tasks["steps"], description=f"steps, test accuracy {event.accuracy:.4f}")


def report(workers: list[PipedWorker]) -> int:
    """The roster of a run that passed, or why each worker failed; the run's exit code."""
    done = [(w, w.done) for w in workers if w.exit_code == 0 and w.done]
    if done:
        roster = done[0][1].roster
        title = f"roster of job {roster.job_id} (round {roster.round})"
        table = folding_table("rank", "address", "hostname", "pid", title=title)
        for member in roster.members:
            table.add_row(
                str(member.rank), f"{member.host}:{member.port}", member.hostname, str(member.pid)
            )
        console.print(table)
        for _, event in done:
            result = event.result
            if "model_path" in result:
                metrics = ", ".join(f"{k} {v:.4f}" for k, v in result["metrics"].items())
                console.print(f"model: [bold]{result['model_path']}[/bold] ({metrics})")
    failed = sorted((w for w in workers if w.exit_code != 0), key=cause_first(workers))
    for w in failed:
        reason = w.failed.message if w.failed else (w.stderr[-1] if w.stderr else "no output")
        who = f"rank {w.rank}" if w.rank is not None else f"worker {w.index} (no rank yet)"
        console.print(f"[red]{who} exited {w.exit_code}:[/red] {escape(reason)}")
    if failed:
        return run_exit_code([w.exit_code for w in failed])
    console.print(f"[green]all {len(workers)} workers passed every phase and cleaned up[/green]")
    return 0


def cause_first(workers: list[PipedWorker]) -> Callable[[PipedWorker], tuple[bool, bool, int]]:
    """The order failed workers are told in: the rank whose program failed first (any
    worker's `culprit`), then those that failed of their own, then those that only lost
    a peer."""
    culprits = {w.failed.culprit for w in workers if w.failed and w.failed.culprit is not None}

    def key(w: PipedWorker) -> tuple[bool, bool, int]:
        lost = w.failed is not None and w.failed.error == MemberLost.__name__
        return (w.rank not in culprits, lost, w.index)

    return key


def run_exit_code(failed: list[int | None]) -> int:
    """The run's exit code from its failed workers' codes: the first cause's, not a
    survivor's `MemberLost` (which only says someone else failed first)."""
    causes = [code for code in failed if code not in (None, MemberLost.exit_code)]
    return next(iter(causes), None) or next((c for c in failed if c), None) or 1
