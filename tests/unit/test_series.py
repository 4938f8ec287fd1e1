"""The dashboard's series from members' events, and the clock keys it follows (pure)."""

from __future__ import annotations

import json

from coordinator.barriers.live import Clock
from coordinator.events import Phase, parse_event
from coordinator.service.series import clock_bound, collect, live_clock, member_events

ROSTER = {"job_id": "j", "round": 1, "world_size": 1, "members": []}


def events_of(*lines: dict[str, object]) -> list[object]:
    """Typed events of wire dicts (each must be a valid event)."""
    events = [parse_event(json.dumps(line)) for line in lines]
    assert None not in events
    return events


def test_events_are_read_from_output_and_anything_else_is_skipped() -> None:
    output = b'noise\n{"event": "phase", "t": 1, "phase": "connect"}\n{not json\n{"no": "event"}\n'
    assert member_events(output) == [Phase(t=1.0, phase="connect")]
    assert member_events(output)[0].wire() == {"event": "phase", "t": 1.0, "phase": "connect"}


def test_curves_clocks_staleness_and_gaps_come_from_the_events() -> None:
    events = events_of(
        {"event": "round", "t": 2.0, "rank": 0, "round": 2, "rounds": 2, "metrics": {"ll": 0.3}},
        {"event": "round", "t": 1.0, "rank": 0, "round": 1, "rounds": 2, "metrics": {"ll": 0.5}},
        {"event": "round", "t": 1.0, "rank": 1, "round": 1, "rounds": 2, "metrics": {"ll": 0.5}},
        {"event": "step", "t": 5.0, "rank": 2, "clock": 10, "target": 20},
        {"event": "step", "t": 4.0, "rank": 2, "clock": 8, "target": 20},
        {"event": "phase", "t": 0.5, "rank": 0, "phase": "connect"},
        {"event": "done", "t": 9.0, "rank": 2, "roster": ROSTER,
         "result": {"staleness": {"0": 3, "1": 2}, "passages": [[4, 2], [5, 5], [6, None]]}},
    )  # fmt: skip
    series = collect(events, {"method": "ssp", "staleness": "2"})
    assert [(p.x, p.metrics) for p in series.curve] == [
        (1, {"ll": 0.5}),
        (2, {"ll": 0.3}),
    ]  # rank 0's rounds only, in order
    assert series.clocks == {2: [(4.0, 8), (5.0, 10)]}
    assert series.staleness == {0: 3, 1: 2}
    assert series.gaps == {2: 1, 0: 1}  # passages without a slowest clock are skipped
    assert [e["event"] for e in series.events] == ["phase", "done"]
    assert series.bound == 3


def test_mnist_evaluations_make_the_curve_against_time_since_start() -> None:
    events = events_of(
        {"event": "metrics", "t": 3.5, "rank": 0, "n": 1, "accuracy": 0.8, "loss": 0.6}
    )
    series = collect(events, {"method": "bsp"})
    assert series.curve_x == "evaluation" and series.curve_t == "since start"
    assert series.curve[0].metrics == {"accuracy": 0.8, "loss": 0.6}


def test_the_bound_is_the_largest_gap_each_method_allows() -> None:
    assert clock_bound({}) is None  # no barrier
    assert clock_bound({"method": "asp"}) is None
    assert clock_bound({"method": "bsp"}) == 1
    assert clock_bound({"method": "ssp", "staleness": "3"}) == 4
    assert clock_bound({"method": "dssp", "staleness": "1", "staleness_upper": "4"}) == 5
    assert clock_bound({"method": "ssp", "staleness": "-1"}) is None  # invalid: no bound drawn


def test_clock_keys_of_every_method_are_recognised() -> None:
    value = Clock(7, 1.0, 0.1).dump().encode()
    assert live_clock("/ns/jobs/j/steps/12/clocks/000003", value) == (3, 7)
    assert live_clock("/ns/jobs/j/steps/12/order/000000000007/000001", value) == (1, 7)
    assert live_clock("/ns/jobs/j/steps/12/clocks/000002", b"0000000009") == (2, 9)
    assert live_clock("/ns/jobs/j/steps/12/slowest", b"4") is None
    assert live_clock("/ns/jobs/j/steps/progress/000001", json.dumps({"clock": 1}).encode()) is None
