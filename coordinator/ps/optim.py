"""SGD with momentum and Adam on one flat tensor, writing the new weights elsewhere.

A parameter server publishes its weights to pulls that send them while later
updates run. An update that wrote the published tensor in place would need a
copy per pull (or a lock held while bytes travel); this one reads the
published weights and writes the next ones to a free buffer, at the cost of an
in-place step. The arithmetic is torch's `SGD` (no dampening, no Nesterov) and
`Adam` (no AMSGrad, no weight decay), step for step; a test holds it to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


@dataclass(frozen=True)
class OptimizerSpec:
    name: str  # sgd | adam
    lr: float
    momentum: float = 0.0  # SGD only
    decay: float = 1.0  # the learning rate is multiplied by this every `decay_every` updates
    decay_every: int = 0


class FlatOptimizer:
    """The optimizer state of one flat parameter, and its out-of-place step."""

    def __init__(self, spec: OptimizerSpec, size: int) -> None:
        if spec.name not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be sgd or adam, not {spec.name!r}")
        self.name, self.lr, self.momentum = spec.name, spec.lr, spec.momentum
        self.decay, self.decay_every = spec.decay, spec.decay_every
        self.steps = 0
        self.buffers: dict[str, torch.Tensor] = {}
        if self.name == "adam":
            self.buffers = {"exp_avg": torch.zeros(size), "exp_avg_sq": torch.zeros(size)}
            self._denominator = torch.empty(size)
        elif self.momentum:
            self.buffers = {"momentum": torch.empty(size)}

    @torch.no_grad()
    def step(
        self,
        weights: torch.Tensor,
        grad: torch.Tensor,
        out: torch.Tensor,
        scale: float = 1.0,
        momentum: float | None = None,
    ) -> None:
        """`out` = `weights` after one step with `grad`; `weights` is only read. `scale`
        multiplies this step's lr (SGD: this gradient's share of the momentum buffer);
        `momentum` replaces SGD's for this step and later ones (an update rule's, see
        `coordinator.ps.rules`). Every `decay_every` steps the learning rate is then
        multiplied by `decay` (the live server and the simulator share this schedule)."""
        self.steps += 1
        if momentum is not None:  # a rule only ever lowers it: the buffer is there or unneeded
            self.momentum = momentum
        if self.name == "adam":
            self._adam(weights, grad, out, scale)
        else:
            self._sgd(weights, grad, out, scale)
        if self.decay_every and self.steps % self.decay_every == 0:
            self.lr *= self.decay

    def _sgd(
        self, weights: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, scale: float
    ) -> None:
        if "momentum" not in self.buffers:
            torch.add(weights, grad, alpha=-self.lr * scale, out=out)
            return
        buffer = self.buffers["momentum"]
        if self.steps == 1:
            buffer.copy_(grad)
            if scale != 1.0:
                buffer.mul_(scale)
        elif scale == 1.0:
            buffer.mul_(self.momentum).add_(grad)
        else:
            buffer.mul_(self.momentum).add_(grad, alpha=scale)
        torch.add(weights, buffer, alpha=-self.lr, out=out)

    def _adam(
        self, weights: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, scale: float
    ) -> None:
        beta1, beta2 = ADAM_BETAS
        exp_avg, exp_avg_sq = self.buffers["exp_avg"], self.buffers["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = self.lr * scale / (1 - beta1**self.steps)
        denominator = torch.sqrt(exp_avg_sq, out=self._denominator)
        denominator.div_(math.sqrt(1 - beta2**self.steps)).add_(ADAM_EPS)
        torch.addcdiv(weights, exp_avg, denominator, value=-step_size, out=out)

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "steps": self.steps, **self.buffers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"the checkpoint's optimizer is {state.get('name')}, not {self.name}")
        self.lr, self.steps = float(state["lr"]), int(state["steps"])
        for name, buffer in self.buffers.items():
            buffer.copy_(state[name])
