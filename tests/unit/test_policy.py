"""Properties of the pure decision code that both the live barrier and the simulator run."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.barriers import dssp
from coordinator.barriers.policy import BarrierSpec, Method, draw_sample, may_start

clocks = st.lists(st.integers(0, 50), max_size=20)


@given(st.integers(0, 60), clocks, st.integers(0, 10))
def test_may_start_is_the_slowest_observed_within_staleness(clock, observed, bound):
    expected = not observed or min(observed) >= clock - bound
    assert may_start(clock, observed, bound) is expected


@given(st.integers(0, 60), clocks)
def test_asp_never_waits(clock, observed):
    assert may_start(clock, observed, None)


def test_bsp_boundary_is_non_strict():
    # every peer has completed `clock`: BSP lets step clock + 1 start
    assert may_start(3, [3, 3, 4], 0)
    assert not may_start(3, [2, 3, 4], 0)
    assert may_start(5, [1], 4)
    assert not may_start(5, [0], 4)


@given(st.integers(0, 30), st.integers(-2, 40), st.integers(0, 2**32))
def test_draw_sample_is_beta_distinct_peers(size, beta, seed):
    peers = list(range(100, 100 + size))
    rng = random.Random(seed)
    before = rng.getstate()
    sample = draw_sample(rng, peers, beta)
    if beta >= size:
        assert sample == peers
        assert rng.getstate() == before  # draws nothing: beta >= P reproduces SSP exactly
    elif beta <= 0:
        assert sample == []
        assert rng.getstate() == before
    else:
        assert len(sample) == beta == len(set(sample))
        assert set(sample) <= set(peers)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (BarrierSpec(Method.SSP, staleness=-1), "staleness"),
        (BarrierSpec(Method.PBSP, sample=-1), "sample"),
        (BarrierSpec(Method.BSP, staleness=2), "staleness"),
        (BarrierSpec(Method.SSP, staleness=0), "staleness"),
        (BarrierSpec(Method.SSP, staleness=2, sample=3), "sample"),
        (BarrierSpec(Method.DSSP, staleness=3, staleness_upper=2), "staleness_upper"),
        (BarrierSpec(Method.SSP, staleness=2, staleness_upper=4), "staleness_upper"),
    ],
)
def test_spec_validation_names_the_field(spec, field):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        spec.validate()


pushes = st.builds(
    dssp.Pushes,
    clock=st.integers(0, 100),
    last_push=st.floats(0, 100),
    interval=st.floats(0, 10),
)


@given(pushes, pushes, st.floats(0, 120), st.integers(0, 6), st.integers(0, 6))
def test_extra_steps_stays_within_the_room(fastest, slowest, now, s_low, extra):
    r = dssp.extra_steps(fastest, slowest, now, s_low, s_low + extra)
    assert 0 <= r <= extra
    if slowest.last_push + slowest.interval <= now:
        assert r == 0


@given(st.integers(0, 4), st.integers(0, 4), st.lists(st.integers(0, 3), max_size=30))
def test_decide_keeps_the_gap_within_upper_plus_one(s_low, extra, grants):
    """A lone fastest worker facing a stuck slowest one: credit at most once, gap <= S_U + 1."""
    s_high = s_low + extra
    credit = dssp.Credit()
    clock = 0
    for grant in grants:
        if dssp.decide(clock, 0, True, credit, min(grant, extra), s_low):
            clock += 1
    assert clock <= s_high + 1


def test_decide_grants_credit_once_per_episode():
    credit = dssp.Credit()
    assert dssp.decide(3, 0, True, credit, 2, s_low=2)  # first of two extra steps
    assert dssp.decide(4, 0, True, credit, 2, s_low=2)  # the second
    assert not dssp.decide(5, 0, True, credit, 2, s_low=2)  # spent, same episode
    assert not dssp.decide(5, 0, True, credit, 2, s_low=2)
    assert dssp.decide(5, 3, False, credit, 0, s_low=2)  # back within S_L: episode over
    assert dssp.decide(6, 3, True, credit, 1, s_low=2)  # a new episode earns credit again


@settings(max_examples=50)
@given(st.integers(0, 5))
def test_non_fastest_gets_no_credit(s_low):
    credit = dssp.Credit()
    assert not dssp.decide(s_low + 1, 0, False, credit, 3, s_low)
    assert credit.remaining == 0


def test_extra_steps_with_a_tiny_interval_is_capped_not_overflowing():
    # regression: (gap // 5e-324) is inf, and int(inf) raised OverflowError
    fastest = dssp.Pushes(clock=3, last_push=0.0, interval=5e-324)
    slowest = dssp.Pushes(clock=0, last_push=0.0, interval=1.0)
    assert dssp.extra_steps(fastest, slowest, now=0.0, s_low=0, s_high=2) == 2


def test_dssp_predicts_from_the_slowest_clock_that_will_push_last() -> None:
    at_3_soon, at_3_late = dssp.Pushes(3, 10.0, 1.0), dssp.Pushes(3, 10.0, 4.0)
    ahead = dssp.Pushes(5, 0.0, 0.1)
    assert dssp.slowest_of({0: at_3_soon, 1: at_3_late, 2: ahead}) == 1
    assert dssp.slowest_of({4: at_3_soon, 2: at_3_soon, 0: ahead}) == 2  # a tie: lowest rank
