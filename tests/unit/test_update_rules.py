"""Update rules against hand computations on tiny tensors, and their refusals."""

from __future__ import annotations

import pytest
import torch

from coordinator.ps.optim import FlatOptimizer, OptimizerSpec
from coordinator.ps.rules import UpdateRule, Updates, check_rule, default_batch, default_rule


def updates(name: str, trainers: int, aggregate: bool = False, momentum: float = 0.9) -> Updates:
    return Updates(UpdateRule(name), trainers=trainers, aggregate=aggregate, momentum=momentum)


def prepared(rule: Updates, staleness: int = 0) -> tuple[float, float]:
    scale, momentum = rule.prepare(torch.ones(2), staleness, torch.zeros(2))
    return round(scale, 12), round(momentum, 12)


def test_plain_is_the_optimizer_as_given_and_every_rule_is_plain_with_one_trainer() -> None:
    for name in ("plain", "scaled", "async", "staleness", "dc"):
        assert updates(name, 1).prepare(torch.ones(2), 0, torch.zeros(2)) == (1.0, 0.9)
    assert prepared(updates("plain", 16)) == (1.0, 0.9)
    assert prepared(updates("plain", 16, aggregate=True)) == (1.0, 0.9)


def test_scaled_sizes_a_synchronous_step_by_the_square_root_of_p() -> None:
    # P = 4, m = 0.9: sqrt(P) = 2, momentum 1 - 2 * 0.1 = 0.8; averaged: lr x 2,
    # one by one: lr x 2 / 4 (four of them make the averaged step).
    assert prepared(updates("scaled", 4, aggregate=True)) == (2.0, 0.8)
    assert prepared(updates("scaled", 4)) == (0.5, 0.8)
    # P = 400: sqrt(P) = 20 is past A = 10: momentum 0, lr x 10 (one by one x 10 / 400).
    assert prepared(updates("scaled", 400, aggregate=True)) == (10.0, 0.0)
    assert prepared(updates("scaled", 400)) == (0.025, 0.0)


def test_async_hands_momentum_to_the_trainers() -> None:
    # P = 4: momentum 1 - 4 * 0.1 = 0.6, each gradient at the full lr.
    assert prepared(updates("async", 4)) == (1.0, 0.6)
    # P = 16 is past A = 10: momentum 0, each gradient at 10 / 16 of the lr.
    assert prepared(updates("async", 16)) == (0.625, 0.0)
    # Without momentum (A = 1): P one-by-one gradients make one step's worth.
    assert prepared(updates("async", 4, momentum=0.0)) == (0.25, 0.0)


def test_staleness_slows_a_gradient_staler_than_p_and_a() -> None:
    rule = updates("staleness", 4)  # A = 10: a gradient counts from 1 + staleness > 10
    assert prepared(rule, staleness=3) == (1.0, 0.6)
    assert prepared(rule, staleness=9) == (1.0, 0.6)
    assert prepared(rule, staleness=19) == (0.5, 0.6)  # 10 / (1 + 19)
    rule = updates("staleness", 16)  # past A: P = 16 sets the threshold
    assert prepared(rule, staleness=15) == (0.625, 0.0)
    assert prepared(rule, staleness=39) == (0.25, 0.0)  # 10 / 40


def test_dc_compensates_the_gradient_for_the_updates_since_its_pull() -> None:
    rule = Updates(UpdateRule("dc", 0.5), trainers=4, aggregate=False, momentum=0.9)
    grad = torch.tensor([1.0, 2.0, -1.0])
    now, pulled = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.5, 2.0, 0.0])
    assert rule.prepare(grad, 3, now, pulled) == (1.0, pytest.approx(0.6))
    # g + 0.5 * g * g * (now - pulled): 1 + 0.5 * 1 * 0.5, 2 + 0.5 * 4 * -1, -1 + 0
    assert torch.equal(grad, torch.tensor([1.25, 0.0, -1.0]))
    fresh = torch.tensor([1.0, 2.0, -1.0])
    rule.prepare(fresh, 0, now, pulled)  # staleness 0: nothing to compensate
    assert torch.equal(fresh, torch.tensor([1.0, 2.0, -1.0]))
    assert rule.keeps_pulled_weights
    assert not Updates(
        UpdateRule("dc"), trainers=4, aggregate=True, momentum=0.9
    ).keeps_pulled_weights


def test_a_scaled_step_with_momentum_by_hand() -> None:
    """SGD's buffer takes the scaled gradient: b = m b + s g, w = w - lr b."""
    optimizer = FlatOptimizer(OptimizerSpec("sgd", 0.1, 0.9), 2)
    w0 = torch.tensor([1.0, 2.0])
    w1, w2 = torch.empty(2), torch.empty(2)
    optimizer.step(w0, torch.tensor([0.5, -1.0]), w1, scale=0.5, momentum=0.8)
    # b = 0.5 * [0.5, -1] = [0.25, -0.5]; w = [1, 2] - 0.1 b
    torch.testing.assert_close(w1, torch.tensor([0.975, 2.05]))
    optimizer.step(w1, torch.tensor([1.0, 1.0]), w2, scale=0.5, momentum=0.8)
    # b = 0.8 [0.25, -0.5] + 0.5 [1, 1] = [0.7, 0.1]; w = w1 - 0.1 b
    torch.testing.assert_close(w2, torch.tensor([0.905, 2.04]))
    assert torch.equal(w0, torch.tensor([1.0, 2.0]))  # read, never written


def test_a_rule_that_drops_momentum_to_zero_steps_with_the_plain_gradient() -> None:
    optimizer = FlatOptimizer(OptimizerSpec("sgd", 0.1), 2)  # no momentum buffer at all
    out = torch.empty(2)
    optimizer.step(torch.tensor([1.0, 1.0]), torch.tensor([1.0, -2.0]), out, scale=0.25)
    torch.testing.assert_close(out, torch.tensor([0.975, 1.05]))


def test_the_default_rule_follows_the_updates() -> None:
    assert default_rule("sgd", aggregate=True) == UpdateRule("scaled")
    assert default_rule("sgd") == UpdateRule("async")
    assert default_rule("adam") == default_rule("adam", aggregate=True) == UpdateRule("plain")


def test_the_default_batch_keeps_enough_rounds_at_large_p() -> None:
    """32 a trainer up to 8 trainers, then a round of 256 samples, never below 8."""
    sizes = {p: default_batch(p) for p in (1, 4, 8, 9, 16, 32, 64, 1000)}
    assert sizes == {1: 32, 4: 32, 8: 32, 9: 28, 16: 16, 32: 8, 64: 8, 1000: 8}


@pytest.mark.parametrize(
    ("name", "compensation", "optimizer", "says"),
    [
        ("bogus", 0.5, "sgd", "update_rule must be one of plain, scaled, async"),
        ("dc", -0.1, "sgd", r"compensation must be in \[0, 10\], got -0.1"),
        ("dc", 11, "sgd", r"compensation must be in \[0, 10\], got 11"),
        ("dc", float("nan"), "sgd", "compensation must be in"),
        ("dc", "1", "sgd", "compensation must be a number"),
        ("async", 0.5, "adam", "update_rule=async sizes SGD's steps"),
    ],
)
def test_bad_rules_are_refused_naming_the_parameter(
    name: str, compensation: float, optimizer: str, says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        check_rule(name, compensation, optimizer)
