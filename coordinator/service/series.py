"""A job's history for the dashboard's charts, from its members' JSON events (pure).

Members print one JSON event per line (`coordinator.events`); these are all a
chart needs, so nothing more is stored for it:

- `round` (xgboost): the evaluation metrics after each boosting round;
- `metrics` (mnist, the first server): test accuracy and loss, `t` seconds
  after training began;
- `step` (mnist trainers and steps members, at most every 0.5 s): a member's clock
  and loss (`null` for a steps job, which trains nothing);
- `done` (every member): a trainer's result holds the staleness of the
  weights it trained on (versions behind -> steps).

The live step clocks of barrier jobs come from etcd instead (`live_clock`):
they change at every step, and every job kind that steps keeps them there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, Field

from coordinator.barriers.live import Clock
from coordinator.barriers.policy import Method
from coordinator.events import (
    Done,
    Failed,
    MemberEvent,
    Metrics,
    Phase,
    Report,
    Round,
    Step,
    parse_events,
)
from coordinator.jobs.steps import parse_barrier
from coordinator.keys import step_clock_rank


class CurvePoint(BaseModel):
    t: float  # Unix time (xgboost) or seconds since training began (mnist)
    x: int  # round (xgboost) or evaluation number (mnist)
    metrics: dict[str, float]


class Series(BaseModel):
    curve: list[CurvePoint] = Field(default_factory=list)
    curve_x: str = "round"  # what `x` counts: "round" or "evaluation"
    curve_t: str = "unix"  # what `t` is: "unix" or "since start"
    clocks: dict[int, list[tuple[float, int]]] = Field(default_factory=dict)  # rank -> (t, clock)
    staleness: dict[int, int] = Field(default_factory=dict)  # versions behind -> steps
    # steps ahead of the slowest trainer, as each trainer saw it when it began a step
    # (steps jobs report their passages) -> steps
    gaps: dict[int, int] = Field(default_factory=dict)
    bound: int | None = None  # the largest clock gap the method allows (None: none)
    events: list[dict[str, Any]] = Field(default_factory=list)  # members' phases and ends


def collect(events: Iterable[MemberEvent], params: dict[str, str]) -> Series:
    """The series of one attempt's events (every member's, in any order)."""
    series = Series(bound=clock_bound(params))
    rounds: dict[int, CurvePoint] = {}
    for event in events:
        if isinstance(event, Round) and event.rank == 0:
            rounds[event.round] = CurvePoint(t=event.t, x=event.round, metrics=event.metrics)
        elif isinstance(event, Metrics):
            series.curve_x, series.curve_t = "evaluation", "since start"
            metrics = _numbers({"accuracy": event.accuracy, "loss": event.loss})
            series.curve.append(CurvePoint(t=event.t, x=event.n, metrics=metrics))
        elif isinstance(event, Report) and event.metrics and event.rank in (0, None):
            # A program's own metrics (`ctx.report`), any names: rank 0's make the curve.
            series.curve_x, series.curve_t = "step", "unix"
            x = event.step if event.step is not None else len(series.curve)
            series.curve.append(CurvePoint(t=event.t, x=x, metrics=_numbers(event.metrics)))
        elif isinstance(event, Step):
            series.clocks.setdefault(event.rank, []).append((event.t, event.clock))
        if isinstance(event, Phase | Failed | Done):
            keep = ("event", "t", "rank", "phase", "error", "message", "exit_code")
            fields = event.wire()
            series.events.append({k: fields[k] for k in keep if k in fields})
        if isinstance(event, Done):
            _note_result(series, event.result)
    if rounds:
        series.curve = [rounds[n] for n in sorted(rounds)]
    series.curve.sort(key=lambda point: point.t)
    series.events.sort(key=lambda event: event.get("t", 0))
    for points in series.clocks.values():
        points.sort()
    return series


def clock_bound(params: dict[str, str]) -> int | None:
    """How far ahead of the slowest trainer the method lets the fastest be, in steps
    (None: no bound, or no barrier). Sampled methods bound the gap to the peers each
    trainer samples only, so theirs is the nominal bound."""
    if "method" not in params:
        return None
    try:
        spec, _ = parse_barrier("dashboard", params)
    except ValueError:
        return None
    if spec.method == Method.DSSP:
        return spec.staleness_upper + 1
    return None if spec.bound is None else spec.bound + 1


def live_clock(key: str, value: bytes) -> tuple[int, int] | None:
    """(rank, clock) of a barrier's clock key, or None for any other key."""
    rank = step_clock_rank(key)
    if rank is None:
        return None
    try:
        clock = Clock.parse(value).clock if value.startswith(b"{") else int(value)
    except (ValueError, KeyError):
        return None
    return rank, clock


def member_events(output: bytes) -> list[MemberEvent]:
    """The events in a member's output (whole lines; anything else is skipped)."""
    return parse_events(output)


def _note_result(series: Series, result: dict[str, Any]) -> None:
    """A trainer's staleness and passages, from its `done` result (the job's own shape:
    anything else there is skipped)."""
    staleness = result.get("staleness")
    for behind, steps in staleness.items() if isinstance(staleness, dict) else []:
        with contextlib.suppress(TypeError, ValueError):
            series.staleness[int(behind)] = series.staleness.get(int(behind), 0) + int(steps)
    passages = result.get("passages")
    for passage in passages if isinstance(passages, list) else []:
        with contextlib.suppress(TypeError, ValueError):
            clock, slowest = passage[0], passage[1]
            if slowest is not None and slowest >= 0:
                gap = int(clock) - int(slowest)
                series.gaps[gap] = series.gaps.get(gap, 0) + 1


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float)}
