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
    """The optimizer state of one flat parameter, and its out-of-place step.

    A step may go slice by slice (`begin`, `step_slice` over disjoint slices covering
    the tensor, `commit`), so a server can update each part of the gradient as it
    arrives. The new optimizer state is written beside the current one and becomes
    current only at `commit`: a step abandoned half-way (`abort`, or simply never
    committed) leaves the state as it was. Adam counts the step once, at `commit`.
    """

    def __init__(self, spec: OptimizerSpec, size: int) -> None:
        if spec.name not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be sgd or adam, not {spec.name!r}")
        self.name, self.lr, self.momentum = spec.name, spec.lr, spec.momentum
        self.steps = 0
        names = ["exp_avg", "exp_avg_sq"] if self.name == "adam" else []
        if self.name == "sgd" and self.momentum:
            names = ["momentum"]
        #: The committed state; `_next` is where a step writes the state after it.
        self.buffers: dict[str, torch.Tensor] = {name: torch.zeros(size) for name in names}
        self._next: dict[str, torch.Tensor] = {name: torch.zeros(size) for name in names}
        self._denominator = torch.empty(size) if self.name == "adam" else None
        self._open = False

    @torch.no_grad()
    def step(self, weights: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
        """`out` = `weights` after one step with `grad`; `weights` is only read."""
        self.begin()
        self.step_slice(slice(0, weights.numel()), weights, grad, out)
        self.commit()

    def begin(self) -> None:
        """Start a step; then `step_slice` over the whole tensor, then `commit`."""
        self._open = True

    @torch.no_grad()
    def step_slice(
        self, part: slice, weights: torch.Tensor, grad: torch.Tensor, out: torch.Tensor
    ) -> None:
        """`out[part]` = `weights[part]` after this step with `grad[part]` (the slice's
        elements of the step; the other slices are independent of it)."""
        assert self._open, "step_slice outside begin() ... commit()"
        steps = self.steps + 1  # the step being taken
        w, g, o = weights[part], grad[part], out[part]
        if self.name == "adam":
            self._adam(part, steps, w, g, o)
            return
        direction = g
        if self.momentum:
            old, new = self.buffers["momentum"][part], self._next["momentum"][part]
            if steps == 1:
                new.copy_(g)
            else:
                torch.mul(old, self.momentum, out=new).add_(g)
            direction = new
        torch.add(w, direction, alpha=-self.lr, out=o)

    def _adam(
        self, part: slice, steps: int, w: torch.Tensor, g: torch.Tensor, o: torch.Tensor
    ) -> None:
        beta1, beta2 = ADAM_BETAS
        exp_avg = torch.lerp(
            self.buffers["exp_avg"][part], g, 1 - beta1, out=self._next["exp_avg"][part]
        )
        exp_avg_sq = torch.mul(
            self.buffers["exp_avg_sq"][part], beta2, out=self._next["exp_avg_sq"][part]
        )
        exp_avg_sq.addcmul_(g, g, value=1 - beta2)
        step_size = self.lr / (1 - beta1**steps)
        assert self._denominator is not None
        denominator = torch.sqrt(exp_avg_sq, out=self._denominator[part])
        denominator.div_(math.sqrt(1 - beta2**steps)).add_(ADAM_EPS)
        torch.addcdiv(w, exp_avg, denominator, value=-step_size, out=o)

    def commit(self) -> None:
        """The step's state becomes current; the step is counted."""
        assert self._open, "commit without begin()"
        self.buffers, self._next = self._next, self.buffers
        self.steps += 1
        self._open = False

    def abort(self) -> None:
        """Forget a step begun and not committed: the state stays as before it."""
        self._open = False

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "steps": self.steps, **self.buffers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"the checkpoint's optimizer is {state.get('name')}, not {self.name}")
        self.lr, self.steps = float(state["lr"]), int(state["steps"])
        for name, buffer in self.buffers.items():
            buffer.copy_(state[name])
