"""The simulator: barrier guarantees, exact reductions (beta = 0 / beta >= P), seeding, CLI."""

from __future__ import annotations

import csv
import hashlib
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.barriers.arguments import barrier_list
from coordinator.barriers.policy import BarrierSpec, Method, SampleTiming, draw_sample
from coordinator.simulator.delays import (
    Gamma,
    ShiftedExponential,
    Stragglers,
    Trace,
    parse_delay,
    sampler,
)
from coordinator.simulator.engine import Result, simulate
from coordinator.simulator.report import write_csv
from coordinator.simulator.strategies import _Others

ROOT = Path(__file__).resolve().parents[2]

small = settings(max_examples=25, deadline=None)
workers = st.integers(1, 12)
durations = st.floats(0, 25)
seeds = st.integers(0, 2**16)
delays = st.sampled_from([ShiftedExponential(1, 1), Gamma(2, 0.5), Stragglers(0.25, 4)])
timings = st.sampled_from(list(SampleTiming))


def outcome(result: Result) -> tuple[list[int], list[float], list[int], int]:
    return result.final_step, result.wait_seconds, result.max_gap, result.events


@small
@given(workers, durations, seeds, delays)
def test_bsp_gap_at_most_one(n, seconds, seed, delay):
    result = simulate(BarrierSpec(Method.BSP), n, seconds, delay, seed)
    assert result.largest_gap <= 1
    assert max(result.final_step) - min(result.final_step) <= 1


@small
@given(workers, durations, seeds, st.integers(1, 5))
def test_ssp_gap_at_most_s_plus_one(n, seconds, seed, s):
    result = simulate(BarrierSpec(Method.SSP, staleness=s), n, seconds, seed=seed)
    assert result.largest_gap <= s + 1


@small
@given(st.integers(2, 10), durations, seeds, st.integers(0, 3), st.integers(0, 4), delays)
def test_dssp_gap_and_progress_between_its_bounds(n, seconds, seed, s_low, extra, delay):
    """'Between' per worker: SSP(S_L) final step <= DSSP's <= SSP(S_U)'s, same seed.

    Holds pathwise because step k of worker w lasts the same under every method
    and DSSP's pass condition lies between SSP(S_L)'s and SSP(S_U)'s; SSP(0) is BSP.
    """
    s_high = s_low + extra
    run = simulate(BarrierSpec(Method.DSSP, s_low, staleness_upper=s_high), n, seconds, delay, seed)
    assert run.largest_gap <= s_high + 1

    def ssp(s: int) -> list[int]:
        spec = BarrierSpec(Method.SSP, s) if s else BarrierSpec(Method.BSP)
        return simulate(spec, n, seconds, delay, seed).final_step

    lower, upper = ssp(s_low), ssp(s_high)
    assert all(lo <= d <= up for lo, d, up in zip(lower, run.final_step, upper, strict=True))


def test_dssp_credit_lets_it_outrun_ssp_lower_bound():
    # The bound test above must be able to see a difference: here DSSP gains steps.
    delay = Stragglers(0.25, 3)
    dssp = simulate(BarrierSpec(Method.DSSP, 1, staleness_upper=6), 8, 100, delay, seed=3)
    ssp = simulate(BarrierSpec(Method.SSP, 1), 8, 100, delay, seed=3)
    assert dssp.mean_step > ssp.mean_step
    assert dssp.largest_gap > 2  # it did use credit beyond S_L + 1


@small
@given(workers, durations, seeds, timings, st.integers(0, 3))
def test_beta_zero_is_asp(n, seconds, seed, timing, s):
    asp = simulate(BarrierSpec(Method.ASP), n, seconds, seed=seed, timing=timing)
    spec = BarrierSpec(Method.PSSP, s, 0) if s else BarrierSpec(Method.PBSP, sample=0)
    assert outcome(simulate(spec, n, seconds, seed=seed, timing=timing)) == outcome(asp)


@small
@given(workers, durations, seeds, timings, st.integers(0, 3), st.integers(0, 5), delays)
def test_beta_covering_everyone_is_ssp_or_bsp(n, seconds, seed, timing, s, more, delay):
    # per-check samples all P workers (itself included), per-step the P - 1 others
    beta = (n if timing == SampleTiming.PER_CHECK else n - 1) + more
    full = BarrierSpec(Method.SSP, s) if s else BarrierSpec(Method.BSP)
    spec = BarrierSpec(Method.PSSP, s, beta) if s else BarrierSpec(Method.PBSP, sample=beta)
    expected = simulate(full, n, seconds, delay, seed)
    assert outcome(simulate(spec, n, seconds, delay, seed, timing)) == outcome(expected)


@small
@given(st.integers(2, 12), durations, seeds, timings, st.sampled_from(list(Method)))
def test_fixed_seed_reproduces_bit_for_bit(n, seconds, seed, timing, method):
    spec = {
        Method.SSP: BarrierSpec(Method.SSP, 2),
        Method.PBSP: BarrierSpec(Method.PBSP, sample=1),
        Method.PSSP: BarrierSpec(Method.PSSP, 1, 2),
        Method.DSSP: BarrierSpec(Method.DSSP, 1, staleness_upper=3),
    }.get(method, BarrierSpec(method))
    first = simulate(spec, n, seconds, Gamma(2, 0.5), seed, timing)
    again = simulate(spec, n, seconds, Gamma(2, 0.5), seed, timing)
    assert outcome(first) == outcome(again)


def test_another_seed_gives_another_run():
    spec = BarrierSpec(Method.PBSP, sample=2)
    assert simulate(spec, 20, 30, seed=1).final_step != simulate(spec, 20, 30, seed=2).final_step


@small
@given(workers, durations, seeds, st.integers(1, 4))
def test_ssp_progress_grows_with_staleness(n, seconds, seed, s):
    # common random numbers: more staleness can only let every worker go further
    tighter = simulate(BarrierSpec(Method.SSP, s), n, seconds, seed=seed).final_step
    looser = simulate(BarrierSpec(Method.SSP, s + 1), n, seconds, seed=seed).final_step
    assert all(a <= b for a, b in zip(tighter, looser, strict=True))


@small
@given(st.integers(2, 12), durations, seeds, timings)
def test_waiting_time_is_accounted(n, seconds, seed, timing):
    result = simulate(BarrierSpec(Method.PBSP, sample=1), n, seconds, seed=seed, timing=timing)
    assert all(0 <= wait <= seconds + 1e-9 for wait in result.wait_seconds)
    asp = simulate(BarrierSpec(Method.ASP), n, seconds, seed=seed)
    assert asp.wait_seconds == [0.0] * n
    # waiting only costs steps: nobody gets further than under ASP
    assert all(a <= b for a, b in zip(result.final_step, asp.final_step, strict=True))


@pytest.mark.parametrize(
    "spec", [BarrierSpec(Method.PBSP, sample=3), BarrierSpec(Method.PSSP, 2, 3)]
)
def test_fast_per_check_matches_the_literal_decision_code(spec):
    """The per-check fast path draws the same pass probability as draw_sample + may_start."""
    fast = [simulate(spec, 40, 40, seed=s).mean_step for s in range(12)]
    exact = [simulate(spec, 40, 40, seed=s, exact_checks=True).mean_step for s in range(12)]
    assert sum(fast) == pytest.approx(sum(exact), rel=0.02)
    bsp = simulate(BarrierSpec(Method.BSP), 40, 40, seed=0).mean_step
    asp = simulate(BarrierSpec(Method.ASP), 40, 40, seed=0).mean_step
    assert bsp < sum(fast) / 12 < asp


def test_reference_experiment_matches_the_book_text():
    # The Owl chapter: BSP reaches about step 30, ASP about 100 (200 workers, 200 s).
    bsp = simulate(BarrierSpec(Method.BSP), 200, 200, seed=0)
    asp = simulate(BarrierSpec(Method.ASP), 200, 200, seed=0)
    assert 25 <= bsp.mean_step <= 35
    assert 90 <= asp.mean_step <= 110


def test_start_is_simultaneous_and_nothing_past_the_end():
    # one worker, constant 1 s steps: exactly floor(seconds) steps, never a partial one
    result = simulate(BarrierSpec(Method.BSP), 1, 10.5, ShiftedExponential(1, 0), seed=0)
    assert result.final_step == [10]
    assert result.wait_seconds == [0.0]


# --- delay models -----------------------------------------------------------------------------


def test_parse_delay_kinds():
    assert parse_delay("exp:1,1") == ShiftedExponential(1, 1)
    assert parse_delay("gamma:2,0.5") == Gamma(2, 0.5)
    straggle = parse_delay("straggler:0.05,4")
    assert isinstance(straggle, Stragglers)
    assert (straggle.fraction, straggle.factor) == (0.05, 4)
    assert parse_delay("straggler:0.5,2,gamma:2,1") == Stragglers(0.5, 2, Gamma(2, 1))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("exp:1", "shift,mean"),
        ("exp:one,1", "shift must be a number"),
        ("exp:1,-1", "mean must be"),
        ("gamma:2,x", "scale must be a number"),
        ("gamma:0,1", "shape must be"),
        ("straggler:2,4", "fraction must be in"),
        ("straggler:0.1,0", "factor must be"),
        ("straggler:0.1,2,exp:x,1", "shift must be a number"),
        ("weibull:1,2", "kind 'weibull' unknown"),
        ("exp", "KIND:ARGS"),
        ("trace:", "trace:PATH"),
        ("trace:/nonexistent/t.csv", "/nonexistent/t.csv"),
    ],
)
def test_parse_delay_errors_name_the_field(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_delay(spec)


def test_stragglers_are_a_fixed_fraction_slowed_by_the_factor():
    model = Stragglers(0.05, 4, ShiftedExponential(1, 0))
    slow = [w for w in range(200) if model.is_straggler(w)]
    assert len(slow) == 10
    assert model.sample(slow[0], 1, None) == 4.0  # type: ignore[arg-type]
    assert model.sample(slow[0] + 1, 1, None) == 1.0  # type: ignore[arg-type]


def _trace(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_trace_replays_the_recorded_durations(tmp_path):
    path = _trace(tmp_path, "worker,step,seconds\n0,1,1.5\n0,2,2.5\n1,1,3\n")
    model = parse_delay(f"trace:{path}")
    assert isinstance(model, Trace)
    assert [model.sample(0, k, None) for k in (1, 2, 3)] == [1.5, 2.5, 1.5]  # type: ignore[arg-type]
    # worker 1 alone: 3 s steps, 10 s -> 3 steps; worker 0 alternates 1.5/2.5 -> 5 steps
    result = simulate(BarrierSpec(Method.ASP), 2, 10, model)
    assert result.final_step == [5, 3]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("worker,step\n0,1\n", "missing column"),
        ("worker,step,seconds\n0,1,x\n", "row 2"),
        ("worker,step,seconds\n0,1,1\n0,1,2\n", "row 3: duplicate step"),
        ("worker,step,seconds\n0,1,-1\n", "row 2: seconds must be"),
        ("worker,step,seconds\n0,2,1\n", "steps must be 1..1"),
        ("worker,step,seconds\n1,1,1\n", "numbered 0..0"),
        ("worker,step,seconds\n", "no rows"),
    ],
)
def test_trace_errors_name_file_and_row(tmp_path, text, message):
    path = _trace(tmp_path, text)
    with pytest.raises(ValueError, match=message) as caught:
        parse_delay(f"trace:{path}")
    assert str(path) in str(caught.value)


# --- barrier list and report ------------------------------------------------------------------


def test_barrier_list_and_flags():
    specs = barrier_list("bsp,asp,ssp:4,pbsp:10,pssp:4:10,dssp:2:6")
    assert [str(s) for s in specs] == [
        "bsp",
        "asp",
        "ssp(s=4)",
        "pbsp(beta=10)",
        "pssp(s=4, beta=10)",
        "dssp(S_L=2, S_U=6)",
    ]
    assert barrier_list("pssp", staleness=4, sample=10) == [BarrierSpec(Method.PSSP, 4, 10)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bsp,foo", "item 2.*method='foo' is not one of"),
        ("ssp:x", "staleness must be an integer"),
        ("pssp:4", "expected pssp:STALENESS:SAMPLE"),
        ("pssp", "staleness missing"),
        ("ssp:0", "needs staleness >= 1"),
        ("dssp:4:2", "staleness_upper"),
    ],
)
def test_barrier_list_errors_name_the_field(text, message):
    with pytest.raises(ValueError, match=message):
        barrier_list(text)


def test_csv_has_a_method_column_only_for_several_methods(tmp_path):
    one = simulate(BarrierSpec(Method.BSP), 3, 5, seed=0)
    write_csv([one], tmp_path / "one.csv")
    rows = list(csv.reader((tmp_path / "one.csv").open()))
    assert rows[0] == ["worker", "final_step", "wait_seconds", "max_gap"]
    assert [int(r[1]) for r in rows[1:]] == one.final_step


def test_cli_end_to_end(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator",
            "simulate",
            "--workers",
            "30",
            "--seconds",
            "20",
            "--barrier",
            "bsp,asp,pssp:2:3",
            "--seed",
            "7",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader((out / "steps.csv").open()))
    assert len(rows) == 90
    by_method = {row["method"] for row in rows}
    assert by_method == {"bsp", "asp", "pssp(s=2, beta=3) per-check"}
    bsp = simulate(BarrierSpec(Method.BSP), 30, 20, seed=7)
    assert [int(r["final_step"]) for r in rows if r["method"] == "bsp"] == bsp.final_step
    assert (out / "steps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mean step" in done.stdout


def test_cli_names_the_bad_field(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "simulate", "--barrier", "ssp:x", "--out", tmp_path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    text = " ".join(done.stderr.replace("│", " ").split())  # undo rich's boxed wrapping
    assert "--barrier" in text and "staleness must be an integer" in text
    assert not (tmp_path / "steps.csv").exists()


# --- the scale rewrite (issue 20): same runs where the random stream is kept, same law elsewhere


def _fingerprint(r: Result) -> str:
    text = repr((r.final_step, r.wait_seconds, r.max_gap, r.events, r.checks))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.mark.parametrize(
    ("barrier", "timing", "expected"),
    [
        ("bsp", SampleTiming.PER_CHECK, "afa377b36463dc66"),
        ("ssp:3", SampleTiming.PER_CHECK, "2300c34e46c0d0ad"),
        ("asp", SampleTiming.PER_CHECK, "196e0febc2e34109"),
        ("dssp:1:5", SampleTiming.PER_CHECK, "e6cc4d50d409e745"),
        ("dssp:2:6", SampleTiming.PER_CHECK, "a5d518cd7873e6cb"),
        ("pbsp:4", SampleTiming.PER_STEP, "dbbca91078e65815"),
        ("pssp:2:5", SampleTiming.PER_STEP, "8dae8654202c517f"),
    ],
)
def test_runs_match_the_engine_before_the_scale_rewrite(barrier, timing, expected):
    """Fingerprints recorded with the O(P)-scan engine (commit ba3c2a6): bit for bit."""
    (spec,) = barrier_list(barrier)
    delay = (
        Stragglers(0.1, 3)
        if timing == SampleTiming.PER_CHECK
        else Stragglers(0.1, 3, Gamma(2, 0.5))
    )
    assert _fingerprint(simulate(spec, 300, 60, delay, seed=5, timing=timing)) == expected


@pytest.mark.parametrize(
    "model",
    [
        ShiftedExponential(1, 1),
        ShiftedExponential(2, 0),
        Gamma(2, 0.5),
        Stragglers(0.3, 4),
        Stragglers(0.5, 2, Gamma(2, 1)),
    ],
)
def test_inlined_delay_draws_are_the_models_own(model):
    rngs, again = ([random.Random(f"3:delay:{w}") for w in range(5)] for _ in range(2))
    draw = sampler(model, rngs)
    assert [draw(w, k) for k in range(1, 40) for w in range(5)] == [
        model.sample(w, k, again[w]) for k in range(1, 40) for w in range(5)
    ]


@pytest.mark.parametrize(
    ("n", "me", "beta"), [(50, 0, 5), (50, 49, 5), (50, 17, 49), (7, 3, 2), (2, 1, 1)]
)
def test_per_step_sample_by_index_is_the_others_sample(n, me, beta):
    by_others = draw_sample(random.Random(n + me), _Others(n, me), beta)
    by_index = [p + (p >= me) for p in draw_sample(random.Random(n + me), range(n - 1), beta)]
    assert by_index == by_others


@pytest.mark.parametrize(
    "spec",
    [
        BarrierSpec(Method.PBSP, sample=2),
        BarrierSpec(Method.PSSP, 1, 4),
        BarrierSpec(Method.PSSP, 3, 1),
    ],
)
def test_event_driven_per_check_has_the_literal_distribution(spec):
    """Mean final step, mean wait and checks per completion: event-driven vs decision code."""
    runs = {
        exact: [
            simulate(spec, 30, 30, Gamma(2, 0.5), seed, exact_checks=exact) for seed in range(16)
        ]
        for exact in (False, True)
    }

    def stats(results: list[Result]) -> tuple[float, float, float]:
        return (
            sum(r.mean_step for r in results) / len(results),
            sum(r.mean_wait for r in results) / len(results),
            sum(r.checks for r in results) / sum(r.events for r in results),
        )

    fast, exact = stats(runs[False]), stats(runs[True])
    assert fast[0] == pytest.approx(exact[0], rel=0.02)
    assert fast[1] == pytest.approx(exact[1], rel=0.1, abs=0.2)
    assert fast[2] == pytest.approx(exact[2], rel=0.1)
