"""Real training in virtual time: P virtual trainers and one virtual server.

The step simulator (`engine.simulate`) decides when each trainer starts and
completes its steps, under the same strategies and the same decision code
(`coordinator.barriers`) as a step-only simulation; this module hooks into it
and does the training for real:

- **Pull.** A trainer that starts a step takes the server's current weights.
  Published weights are never written again (each update writes a new tensor,
  like the server's out-of-place `FlatOptimizer`), so a pull holds a reference,
  not a copy, and what it sees is exactly the weights at its start time.
- **Gradient.** At the step's completion the trainer's gradient is computed for
  real, on the weights it pulled, with its next batch: its own shard of the
  training set (`load_train_shard`), a seeded shuffle per epoch (`batch_rows`,
  the same order as the live `mnist` job).
- **Duration.** Only time is modelled: a step lasts the delay model's draw (its
  compute) plus a transfer (`Transfer`: latency + bytes / bandwidth for the pull
  and again for the push). Every duration is drawn from the trainer's own stream,
  so two methods see the same step times (common random numbers).
- **Update.** At the completion the server applies the gradient with
  `FlatOptimizer` (the live server's arithmetic); the staleness of that gradient
  is the server's version at the update minus the version it pulled. With
  `aggregate=True` (BSP-aggregate) the gradients of step k of all trainers are
  averaged, in trainer order, into one update once the last one arrives.
- **Evaluation** on the whole test set at fixed virtual-time intervals (it sees
  every update completed at or before that time) or every K updates, and at the end.
- **Stop** once `epochs` x the training set's samples have been applied, or at
  `virtual_seconds`, whichever comes first.

Any classifier can be trained so, not only `MnistNet`: `train(..., model=factory,
loss=...)` with `TrainingData.from_tensors(...)` (the same `torch.nn.Module` a user's
program serves through `coordinator.ps.api`). Accuracy is the argmax's against integer
labels; the loss is the given one's, averaged over the test set.

A run depends on nothing but its arguments: one torch thread inside, seeded
generators, no wall clock. The same arguments give the same numbers, bit for bit.

The data are a `training_data.TrainingData`; a run returns a `training_results.TrainingRun`.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional

from coordinator.barriers.policy import BarrierSpec, Method, SampleTiming
from coordinator.jobs.mnist.batches import batch_rows, steps_per_epoch
from coordinator.jobs.mnist.options import CLASSES
from coordinator.ps.model import FlatModel, MnistNet
from coordinator.ps.optim import FlatOptimizer, OptimizerSpec
from coordinator.ps.rules import UpdateRule, Updates, default_batch, default_rule
from coordinator.simulator.delays import DelayModel, ShiftedExponential
from coordinator.simulator.engine import Hooks, simulate
from coordinator.simulator.training_data import TrainingData
from coordinator.simulator.training_results import Evaluation, TrainingRun, label

#: The live mnist job's default optimizer.
DEFAULT_OPTIMIZER = OptimizerSpec("sgd", 0.02, 0.9)
_EVAL_CHUNK = 2000  # test images per forward pass


@dataclass(frozen=True)
class Transfer:
    """The network time of a step: a pull before and a push after, each
    `latency` + bytes / `bandwidth` (defaults: 0.5 ms one way, 10 Gbit/s)."""

    latency: float = 0.0005
    bandwidth: float = 1.25e9  # bytes per second

    def __post_init__(self) -> None:
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"latency must be a finite number >= 0, got {self.latency}")
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0, got {self.bandwidth}")

    def seconds(self, nbytes: int) -> float:
        return 2 * (self.latency + nbytes / self.bandwidth)


@dataclass(frozen=True)
class _PlusTransfer:
    """A delay model whose every draw is the base's plus a fixed transfer time."""

    base: DelayModel
    extra: float

    def sample(self, worker: int, step: int, rng: random.Random) -> float:
        return self.base.sample(worker, step, rng) + self.extra


def initial_weights(
    seed: int, rows: int = 28, cols: int = 28, model: Callable[[], nn.Module] | None = None
) -> nn.Module:
    """The model every method starts from for `seed`: `model()`, or `MnistNet` (torch's
    global RNG left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model() if model is not None else MnistNet(rows, cols, CLASSES)


@contextmanager
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def mean_step_seconds(delay: DelayModel, workers: int, draws: int = 16) -> float:
    """An estimate of the delay model's mean step (a fixed stream: deterministic)."""
    rng = random.Random("mean-step")
    values = [delay.sample(w, k, rng) for w in range(min(workers, 64)) for k in range(1, draws + 1)]
    return sum(values) / len(values)


def train(
    spec: BarrierSpec,
    data: TrainingData,
    *,
    batch_size: int | None = None,
    epochs: float | None = 1.0,
    virtual_seconds: float | None = None,
    delay: DelayModel | None = None,
    seed: int = 0,
    optimizer: OptimizerSpec = DEFAULT_OPTIMIZER,
    rule: UpdateRule | None = None,
    aggregate: bool = False,
    eval_seconds: float | None = None,
    eval_updates: int | None = None,
    transfer: Transfer | None = None,
    timing: SampleTiming = SampleTiming.PER_CHECK,
    stop_accuracy: float | None = None,
    own_shards: bool = False,
    model: Callable[[], nn.Module] | None = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = functional.cross_entropy,
) -> TrainingRun:
    """Train `data.workers` virtual trainers under `spec`; see the module's docstring.

    Give `eval_seconds` (a virtual-time grid) or `eval_updates` (every K updates);
    `epochs` and/or `virtual_seconds` bound the run; `stop_accuracy` also ends it at the
    first evaluation that reaches it (a time-to-accuracy study needs nothing after that).
    `epochs` counts passes over the whole training set, by whichever trainers make them;
    with `own_shards`, each trainer makes `epochs` passes over its own shard and then idles
    (it trains no more and holds nobody back), as the live job's trainers do.
    `batch_size` is each trainer's (default: the live job's, `rules.default_batch`).
    `model` builds the network (default `MnistNet`; it is called with torch seeded by
    `seed`), `loss` scores a batch (the mean over its rows).
    """
    spec.validate()
    workers = data.workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if batch_size is None:
        batch_size = default_batch(workers)
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if epochs is None and virtual_seconds is None:
        raise ValueError("give epochs or virtual_seconds (or both)")
    if epochs is not None and not epochs > 0:
        raise ValueError(f"epochs must be > 0, got {epochs}")
    if virtual_seconds is not None and not virtual_seconds >= 0:
        raise ValueError(f"virtual_seconds must be >= 0, got {virtual_seconds}")
    if (eval_seconds is None) == (eval_updates is None):
        raise ValueError("give exactly one of eval_seconds and eval_updates")
    if eval_seconds is not None and not eval_seconds > 0:
        raise ValueError(f"eval_seconds must be > 0, got {eval_seconds}")
    if eval_updates is not None and eval_updates < 1:
        raise ValueError(f"eval_updates must be >= 1, got {eval_updates}")
    if own_shards and epochs is None:
        raise ValueError("own_shards counts epochs: give epochs")
    if aggregate and spec.method != Method.BSP:
        raise ValueError(f"aggregate is BSP-aggregate: the method must be bsp, not {spec}")
    with _one_thread():
        return _Run(
            spec, data, batch_size, epochs, virtual_seconds, delay or ShiftedExponential(),
            seed, optimizer, rule, aggregate, eval_seconds, eval_updates, transfer or Transfer(),
            timing, stop_accuracy, own_shards, model, loss,
        ).run()  # fmt: skip


class _Run:
    def __init__(
        self,
        spec: BarrierSpec,
        data: TrainingData,
        batch_size: int,
        epochs: float | None,
        virtual_seconds: float | None,
        delay: DelayModel,
        seed: int,
        optimizer: OptimizerSpec,
        rule: UpdateRule,
        aggregate: bool,
        eval_seconds: float | None,
        eval_updates: int | None,
        transfer: Transfer,
        timing: SampleTiming,
        stop_accuracy: float | None,
        own_shards: bool,
        model: Callable[[], nn.Module] | None,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        self.stop_accuracy = stop_accuracy
        self.reached = False
        self.spec, self.data, self.batch_size, self.seed = spec, data, batch_size, seed
        self.aggregate, self.timing = aggregate, timing
        self.eval_seconds, self.eval_updates = eval_seconds, eval_updates
        self.virtual_seconds = virtual_seconds
        self.target = None if epochs is None else math.ceil(epochs * data.train_count)
        #: Each trainer's own number of steps (`own_shards`), as the live job counts them.
        self.limits = (
            [math.ceil(epochs * steps_per_epoch(len(y), batch_size)) for _, y in data.shards]
            if own_shards and epochs is not None
            else None
        )
        self.unfinished = len(self.limits or ())  # trainers short of their limit
        n = data.workers
        # The trainers' model: gradients are computed here, on each trainer's pulled weights.
        self.loss = loss
        self.work = FlatModel.build(initial_weights(seed, data.rows, data.cols, model), 1)
        self.eval = FlatModel.build(initial_weights(seed, data.rows, data.cols, model), 1)
        size = self.work.params.numel()
        self.server = self.work.params.clone()  # published: never written again
        self.version = 0
        self.optimizer = FlatOptimizer(optimizer, size)
        self.rule = Updates(
            rule or default_rule(optimizer.name, aggregate),
            trainers=n,
            aggregate=aggregate,
            momentum=optimizer.momentum,
        )
        self.delay = _PlusTransfer(delay, transfer.seconds(size * self.work.params.element_size()))
        self.pulled: list[tuple[torch.Tensor, int]] = [(self.server, 0)] * n
        self.steps = [0] * n  # steps completed per trainer: the next batch's index
        self.pending: dict[int, list[tuple[torch.Tensor, int, int] | None]] = {}
        self.updates = self.samples = 0
        self.staleness: Counter[int] = Counter()
        self.evaluations: list[Evaluation] = []
        self.next_eval = 0.0

    def run(self) -> TrainingRun:
        self._evaluate(0.0)
        if self.eval_seconds is not None:
            self.next_eval = self.eval_seconds
        seconds = math.inf if self.virtual_seconds is None else self.virtual_seconds
        hooks = Hooks(started=self._started, completed=self._completed, stop=self._done)
        result = simulate(
            self.spec, self.data.workers, seconds, self.delay, self.seed, self.timing, hooks=hooks
        )
        end = result.seconds
        self._evaluate_until(end, inclusive=True)
        last = self.evaluations[-1]
        if self.reached:
            end = last.virtual_seconds
        elif last.virtual_seconds != end or last.updates != self.updates:
            self._evaluate(end)
        return TrainingRun(
            label=label(self.spec, self.aggregate, self.timing),
            seed=self.seed,
            evaluations=self.evaluations,
            staleness=self.staleness,
            weights=self.server,
            updates=self.updates,
            samples=self.samples,
            virtual_seconds=end,
        )

    # Hooks ----------------------------------------------------------------------------------

    def _started(self, trainer: int, t: float) -> None:
        self.pulled[trainer] = (self.server, self.version)

    def _completed(self, trainer: int, t: float) -> None:
        self._evaluate_until(t, inclusive=False)
        if self.reached:  # an evaluation before this completion reached the target
            return
        if self.limits is not None and self.steps[trainer] >= self.limits[trainer]:
            return  # its shard's epochs are done: an idle step
        weights, version = self.pulled[trainer]
        step = self.steps[trainer]
        self.steps[trainer] = step + 1
        if self.limits is not None and step + 1 == self.limits[trainer]:
            self.unfinished -= 1
        x, y = self.data.shards[trainer]
        batch = batch_rows(self.seed, trainer, len(y), self.batch_size, step)
        work = self.work
        work.params.copy_(weights)
        work.grads.zero_()
        self.loss(work.model(x[batch]), y[batch]).backward()
        if not self.aggregate:
            self.staleness[self.version - version] += 1
            self._apply(work.grads, len(batch), t, self.version - version, weights)
            return
        slots = self.pending.setdefault(step, [None] * self.data.workers)
        slots[trainer] = (work.grads.clone(), version, len(batch))
        limits = self.limits
        expected = [s for w, s in enumerate(slots) if limits is None or limits[w] > step]
        if any(slot is None for slot in expected):
            return
        del self.pending[step]
        total = torch.zeros_like(work.grads)
        samples = 0
        for grad, pulled_version, count in expected:  # type: ignore[misc]
            total += grad
            samples += count
            self.staleness[self.version - pulled_version] += 1
        total /= len(expected)
        self._apply(total, samples, t, 0)

    def _done(self) -> bool:
        if self.reached:
            return True
        if self.limits is not None:
            return self.unfinished == 0
        return self.target is not None and self.samples >= self.target

    # Server -----------------------------------------------------------------------------------

    def _apply(
        self,
        grad: torch.Tensor,
        samples: int,
        t: float,
        staleness: int,
        pulled: torch.Tensor | None = None,
    ) -> None:
        new = torch.empty_like(self.server)
        scale, momentum = self.rule.prepare(grad, staleness, self.server, pulled)
        self.optimizer.step(self.server, grad, new, scale, momentum)
        self.server = new
        self.version += 1
        self.updates += 1
        self.samples += samples
        if self.eval_updates is not None and self.updates % self.eval_updates == 0:
            self._evaluate(t)

    def _evaluate_until(self, t: float, inclusive: bool) -> None:
        if self.eval_seconds is None:
            return
        while not self.reached and (self.next_eval < t or (inclusive and self.next_eval <= t)):
            self._evaluate(self.next_eval)
            self.next_eval = round(self.next_eval + self.eval_seconds, 9)

    @torch.no_grad()
    def _evaluate(self, t: float) -> None:
        self.eval.params.copy_(self.server)
        x, y = self.data.test
        loss = 0.0
        correct = 0
        for low in range(0, len(y), _EVAL_CHUNK):
            logits = self.eval.model(x[low : low + _EVAL_CHUNK])
            target = y[low : low + _EVAL_CHUNK]
            loss += self.loss(logits, target).item() * len(target)
            correct += int((logits.argmax(1) == target).sum())
        n = len(y)
        self.evaluations.append(Evaluation(t, self.updates, self.samples, correct / n, loss / n))
        if self.stop_accuracy is not None and correct / n >= self.stop_accuracy:
            self.reached = True


def default_eval_seconds(
    delay: DelayModel,
    data: TrainingData,
    batch_size: int,
    epochs: float | None,
    virtual_seconds: float | None,
    transfer: Transfer | None = None,
    points: int = 20,
) -> float:
    """A virtual-time grid of about `points` evaluations for an ASP-paced run (slower
    methods get more): the run's bound, or an epoch's steps times the mean step."""
    if virtual_seconds is not None and (epochs is None or virtual_seconds > 0):
        bound = virtual_seconds
    else:
        transfer = transfer or Transfer()
        size = sum(p.numel() for p in MnistNet(data.rows, data.cols, CLASSES).parameters())
        step = mean_step_seconds(delay, data.workers) + transfer.seconds(4 * size)
        longest = max(steps_per_epoch(len(y), batch_size) for _, y in data.shards)
        bound = step * longest * (epochs or 1.0)
    return max(bound / points, 1e-6)


def updates_per_epoch(data: TrainingData, batch_size: int, aggregate: bool) -> int:
    """Server updates while every trainer makes one pass over its shard: the period of
    the live job's `lr_decay`, counted as it counts it."""
    steps = [steps_per_epoch(len(y), batch_size) for _, y in data.shards]
    return max(steps) if aggregate else sum(steps)


def runs_for(
    specs: Sequence[tuple[BarrierSpec, bool]], seeds: Sequence[int]
) -> list[tuple[BarrierSpec, bool, int]]:
    """The (spec, aggregate, seed) runs of a study, method-major."""
    return [(spec, aggregate, seed) for spec, aggregate in specs for seed in seeds]
