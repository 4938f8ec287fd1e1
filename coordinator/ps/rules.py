"""Update rules: how a server turns one (possibly stale) gradient into an optimizer step.

A parameter server's P trainers push gradients computed on weights that other
updates have since moved (a gradient's *staleness*: the server's version at the
update minus the version its trainer pulled), one by one or averaged P at a time.
Applied naively, SGD with momentum m diverges as P grows: the P gradients of a step,
computed near the same weights, add up to a P-times larger step, and asynchrony acts
like extra momentum on top of m. A rule sizes each step from what the server knows
(P, each gradient's staleness, the weights a trainer pulled). Momentum m amplifies a
step A = 1 / (1 - m) times; the rules hand part of that amplification to the P
gradients, so that a step of all P moves about as far as one trainer's step would:

- `plain`: every gradient at the optimizer's lr and momentum, as given (to replicate
  papers that apply gradients naively).
- `scaled`: synchronous steps, a batch P times larger: by the square-root rule for
  large batches, an averaged update takes sqrt(P) times the lr (one-by-one gradients
  sqrt(P) / P of it) and the momentum drops to 1 - sqrt(P) (1 - m).
- `async`: asynchrony acts like momentum 1 - 1/P (asynchrony begets momentum), so the
  explicit momentum drops to 1 - P (1 - m), at least 0; past P = A, one-by-one
  gradients take A / P of the lr.
- `staleness`: `async`, and a gradient whose 1 + staleness exceeds both P and A takes
  A / (1 + staleness) of the lr (staleness-aware SGD: a straggler's old gradient moves
  the weights less).
- `dc`: `async`, and a gradient g pulled at weights w_pulled is first compensated for
  the updates since: g + lambda * g * g * (w_now - w_pulled), elementwise
  (delay-compensated ASGD). The server keeps a copy of the weights each trainer last
  pulled: P more copies of its share.

With one trainer every rule is `plain`. Rules other than `plain` size SGD's momentum, so
they need `sgd`. The defaults (`default_rule`: `scaled` for averaged updates, `async` for
one-by-one ones, under every barrier; `default_batch`: smaller past 8 trainers) are what
the simulator study in docs/methods/update_rules.md found to reach its targets in every
seed. The same code runs in the live server (`coordinator.ps.server`, also under
`coordinator.ps.serve`) and in the simulator (`coordinator.simulator.training`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # checking a rule needs no torch: the service and the CLI check them
    import torch

RULES = ("plain", "scaled", "async", "staleness", "dc")
#: Rules that count the trainers as asynchrony (the others: as a larger batch).
ASYNCHRONOUS = ("async", "staleness", "dc")
#: The largest delay-compensation factor accepted: beyond it the correction outgrows
#: the gradient it corrects.
MAX_COMPENSATION = 10.0
DEFAULT_COMPENSATION = 0.5


@dataclass(frozen=True)
class UpdateRule:
    """A rule's name and `dc`'s lambda (`compensation`)."""

    name: str = "plain"
    compensation: float = DEFAULT_COMPENSATION


def check_rule(name: str, compensation: float, optimizer: str = "sgd") -> UpdateRule:
    """The rule, or a ValueError naming the parameter (`update_rule`, `compensation`)."""
    if name not in RULES:
        raise ValueError(f"update_rule must be one of {', '.join(RULES)}, not {name!r}")
    if isinstance(compensation, bool) or not isinstance(compensation, int | float):
        raise ValueError(f"compensation must be a number, not {compensation!r}")
    if not 0 <= compensation <= MAX_COMPENSATION:
        raise ValueError(f"compensation must be in [0, {MAX_COMPENSATION:g}], got {compensation:g}")
    if name != "plain" and optimizer != "sgd":
        raise ValueError(
            f"update_rule={name} sizes SGD's steps: use it with sgd, or plain with {optimizer}"
        )
    return UpdateRule(name, float(compensation))


def default_batch(trainers: int) -> int:
    """A trainer's batch when the user names none: 32 up to 8 trainers, then 256 / P, at
    least 8 (16 at P = 16, 8 from P = 32 on).

    The rules keep a round of P gradients about as far as one trainer's step, so what
    decides how far a model gets in some epochs is the number of rounds: with 32 a
    trainer, 4 epochs of the digits at P = 16 (31 rounds) and 2 of Fashion-MNIST at
    P = 64 (58 rounds) stopped short of their targets for some methods; with this batch
    every method reached them in every seed (docs/methods/update_rules.md)."""
    return max(8, min(32, 256 // max(trainers, 1)))


def default_rule(optimizer: str, aggregate: bool = False) -> UpdateRule:
    """The rule a user who names none gets: with SGD, `scaled` for averaged updates and
    `async` for gradients applied one by one, whatever the barrier; `plain` with Adam."""
    if optimizer != "sgd":
        return UpdateRule("plain")
    return UpdateRule("scaled" if aggregate else "async")


class Updates:
    """One server's rule at work: per update, the share of the lr it takes and the
    momentum it is applied with; `dc` corrects the gradient itself.

    `trainers`: P; `aggregate`: each update averages P gradients; `momentum`: the
    optimizer's (SGD's m)."""

    def __init__(
        self, rule: UpdateRule, *, trainers: int, aggregate: bool, momentum: float
    ) -> None:
        self.rule, self.aggregate = rule, aggregate
        self.base_momentum = momentum
        self.amplification = 1.0 / (1.0 - momentum)  # of a step, by momentum
        self.scale, self.momentum = 1.0, momentum  # one trainer (or plain): as given
        if trainers > 1 and rule.name != "plain":
            together = float(trainers) if rule.name in ASYNCHRONOUS else trainers**0.5
            self.momentum = max(0.0, 1.0 - together * (1.0 - momentum))
            together = min(together, self.amplification)
            self.scale = together if aggregate else together / trainers
        self._squared: torch.Tensor | None = None  # dc's buffers
        self._moved: torch.Tensor | None = None

    @property
    def keeps_pulled_weights(self) -> bool:
        """Whether `prepare` wants the weights a gradient's trainer pulled (dc)."""
        return self.rule.name == "dc" and not self.aggregate

    def prepare(
        self,
        grad: torch.Tensor,
        staleness: int,
        weights: torch.Tensor,
        pulled: torch.Tensor | None = None,
    ) -> tuple[float, float]:
        """Before the optimizer's step with `grad` (one gradient of `staleness`, or an
        average): returns (lr scale, momentum). `dc` corrects `grad` in place from
        `weights` (the server's, now) and `pulled` (its trainer's, when known)."""
        name = self.rule.name
        if name == "plain":
            return 1.0, self.base_momentum
        if self.aggregate:
            return self.scale, self.momentum
        if name == "staleness" and staleness + 1 > self.amplification / self.scale:
            return self.amplification / (1 + staleness), self.momentum
        if name == "dc" and pulled is not None and staleness > 0:
            self._compensate(grad, weights, pulled)
        return self.scale, self.momentum

    def _compensate(self, grad: torch.Tensor, weights: torch.Tensor, pulled: torch.Tensor) -> None:
        """grad += lambda * grad * grad * (weights - pulled), in two reused buffers."""
        import torch  # here: checking a rule must not need it

        if self._squared is None or self._squared.shape != grad.shape:
            self._squared, self._moved = torch.empty_like(grad), torch.empty_like(grad)
        torch.mul(grad, grad, out=self._squared)
        torch.sub(weights, pulled, out=self._moved)
        grad.addcmul_(self._squared, self._moved, value=self.rule.compensation)
