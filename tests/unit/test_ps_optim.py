"""The parameter server's update path: its optimizer against torch's, and its buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coordinator.ps.optim import FlatOptimizer, OptimizerSpec
from coordinator.ps.published import PublishedWeights

SPECS = {
    "sgd": OptimizerSpec("sgd", 0.05),
    "sgd-momentum": OptimizerSpec("sgd", 0.05, momentum=0.9),
    "adam": OptimizerSpec("adam", 0.01),
}


def torch_optimizer(spec: OptimizerSpec, param: nn.Parameter) -> torch.optim.Optimizer:
    if spec.name == "adam":
        return torch.optim.Adam([param], lr=spec.lr)
    return torch.optim.SGD([param], lr=spec.lr, momentum=spec.momentum)


@pytest.mark.parametrize("name", list(SPECS))
def test_steps_match_torch_and_never_write_the_weights_they_read(name: str) -> None:
    spec = SPECS[name]
    generator = torch.Generator().manual_seed(1)
    start = torch.randn(1000, generator=generator)
    grads = [torch.randn(1000, generator=generator) for _ in range(5)]
    reference = nn.Parameter(start.clone())
    expected = torch_optimizer(spec, reference)
    ours = FlatOptimizer(spec, 1000)
    weights = start.clone()
    for grad in grads:
        reference.grad = grad.clone()
        expected.step()
        read = weights.clone()
        updated = torch.empty(1000)
        ours.step(weights, grad, out=updated)
        assert torch.equal(weights, read)  # published weights stay as they were
        weights = updated
        assert torch.allclose(weights, reference.detach(), atol=1e-6)
    assert not torch.allclose(weights, start)


def test_the_learning_rate_decays_as_torch_step_lr_does() -> None:
    """The live job's schedule (`lr_decay` once per epoch's updates), shared with the
    simulator: after every `decay_every` steps, lr times `decay`."""
    spec = OptimizerSpec("sgd", 0.05, momentum=0.9, decay=0.5, decay_every=2)
    generator = torch.Generator().manual_seed(2)
    start = torch.randn(100, generator=generator)
    reference = nn.Parameter(start.clone())
    expected = torch_optimizer(spec, reference)
    schedule = torch.optim.lr_scheduler.StepLR(expected, step_size=2, gamma=0.5)
    ours, weights = FlatOptimizer(spec, 100), start.clone()
    for _ in range(7):
        grad = torch.randn(100, generator=generator)
        reference.grad = grad.clone()
        expected.step()
        schedule.step()
        updated = torch.empty(100)
        ours.step(weights, grad, out=updated)
        weights = updated
        assert torch.allclose(weights, reference.detach(), atol=1e-6)
    assert ours.lr == pytest.approx(0.05 * 0.5**3)


@pytest.mark.parametrize("name", list(SPECS))
def test_a_restored_state_continues_exactly(name: str) -> None:
    spec = SPECS[name]
    grad = torch.linspace(-1, 1, 100)
    first = FlatOptimizer(spec, 100)
    weights, out = torch.zeros(100), torch.empty(100)
    for _ in range(3):
        first.step(weights, grad, out=out)
        weights, out = out, weights
    second = FlatOptimizer(spec, 100)
    second.load_state_dict(
        {k: v.clone() if torch.is_tensor(v) else v for k, v in first.state_dict().items()}
    )
    a, b = torch.empty(100), torch.empty(100)
    first.step(weights, grad, out=a)
    second.step(weights, grad, out=b)
    assert torch.equal(a, b)


def test_a_checkpoint_of_another_optimizer_is_refused() -> None:
    state = FlatOptimizer(SPECS["adam"], 10).state_dict()
    with pytest.raises(ValueError, match="optimizer is adam, not sgd"):
        FlatOptimizer(SPECS["sgd-momentum"], 10).load_state_dict(state)


def test_an_update_never_writes_weights_a_pull_is_still_sending() -> None:
    published = PublishedWeights(torch.zeros(4))
    sending = published.borrow()
    for _ in range(3):  # updates go on while that pull sends
        target = published.writable()
        assert target is not sending
        published.publish(target)
    published.give_back(sending)  # sent: now it may be written again
    assert any(published.writable() is sending for _ in range(3))
