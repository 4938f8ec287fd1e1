"""A step barrier's arguments are checked in one place: a job's text parameters, a
program's `ctx.steps(...)` and the simulator's `--barrier` list get the same answer and
the same message for the same input (pure)."""

from __future__ import annotations

import pytest

from coordinator.barriers.arguments import barrier_from_params, barrier_list, barrier_spec
from coordinator.barriers.policy import BarrierSpec, Method, OnLoss
from coordinator.jobs.steps import parse_barrier


@pytest.mark.parametrize(
    ("method", "counts", "message"),
    [
        ("xsp", {}, "method='xsp' is not one of bsp, ssp, asp, pbsp, pssp, dssp"),
        ("ssp", {"staleness": "x"}, "staleness must be an integer >= 0, got 'x'"),
        ("ssp", {"staleness": "0"}, "ssp needs staleness >= 1 (got 0)"),
        ("pssp", {"staleness": "1", "sample": "-2"}, "sample must be an integer >= 0, got -2"),
        ("dssp", {"staleness": "4", "staleness_upper": "2"}, "staleness_upper (S_U=2)"),
    ],
)
def test_every_caller_gets_the_same_message(
    method: str, counts: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError) as direct:
        barrier_spec(method, **counts)
    assert message in str(direct.value)
    with pytest.raises(ValueError) as job:
        parse_barrier("mnist", {"method": method, **counts})
    assert str(job.value) == f"mnist job: {direct.value}"
    item = ":".join([method, *counts.values()])
    with pytest.raises(ValueError) as listed:
        barrier_list(item)
    assert str(listed.value) == f"barrier item 1 ({item!r}): {direct.value}"


def test_text_and_values_give_the_same_spec() -> None:
    spec = BarrierSpec(Method.PSSP, staleness=3, sample=2)
    assert barrier_spec("PSSP", 3, 2) == spec
    assert barrier_from_params({"method": "pssp", "staleness": "3", "sample": "2"}) == (
        spec, OnLoss.FAIL,
    )  # fmt: skip
    assert barrier_list("pssp:3:2") == [spec] == barrier_list("pssp", staleness=3, sample=2)


@pytest.mark.parametrize("value", [-1, True, 1.5, None])
def test_a_count_is_an_integer_at_least_zero(value: object) -> None:
    with pytest.raises(ValueError, match="staleness must be an integer >= 0"):
        barrier_spec("ssp", staleness=value)


def test_a_sample_is_no_larger_than_the_other_stepping_members() -> None:
    assert barrier_spec("pbsp", sample=2, stepping=3).sample == 2
    with pytest.raises(ValueError, match="sample=3 is larger than the 2 other stepping"):
        barrier_spec("pbsp", sample=3, stepping=3)


def test_a_job_names_a_missing_method_and_a_bad_on_loss() -> None:
    with pytest.raises(ValueError, match="steps job: parameter method is required"):
        parse_barrier("steps", {})
    with pytest.raises(ValueError, match="on_loss='maybe' is not fail or continue"):
        parse_barrier("steps", {"method": "bsp", "on_loss": "maybe"})
