"""The `mnist` job's parameters, checked whole before a member joins; the model they shape.

Bad input (a parameter, a data file, a trainer without rows) is a ValueError naming the
field, raised on every member alike, so the job exits 2 with nothing written to etcd.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from coordinator.barriers.live import OnLoss
from coordinator.barriers.policy import BarrierSpec, Method
from coordinator.datasets.mnist import MnistSource, check_train_shards, parse_mnist
from coordinator.datasets.shards import plan
from coordinator.jobs import catalog
from coordinator.jobs.mnist.batches import steps_per_epoch
from coordinator.jobs.params import artifacts_dir, check_known, float_param, int_at_least, int_param
from coordinator.jobs.steps import parse_barrier, parse_stop, parse_straggler
from coordinator.ps.model import MnistNet
from coordinator.ps.optim import OptimizerSpec
from coordinator.ps.rules import (
    DEFAULT_COMPENSATION,
    UpdateRule,
    check_rule,
    default_batch,
    default_rule,
)

JOB = "mnist"
CLASSES = 10

KNOWN = catalog.names(catalog.MNIST)


@dataclass(frozen=True)
class MnistOptions:
    """The job's parameters, checked (`parse`); every member derives the same."""

    data: MnistSource
    servers: int
    trainers: int
    spec: BarrierSpec
    on_loss: OnLoss
    epochs: int | None
    num_steps: int | None
    last_step: int | None
    batch_size: int
    optimizer: OptimizerSpec
    rule: UpdateRule
    aggregate: bool
    straggler_rank: int | None
    straggler_factor: float
    eval_seconds: float
    checkpoint_every: int
    resume: bool
    seed: int
    threads: int
    artifacts: Path

    def target(self, trainer: int) -> int:
        """The clock at which `trainer` stops (counted from the job's start)."""
        if self.last_step is not None:
            return self.last_step
        if self.num_steps is not None:
            return self.num_steps
        assert self.epochs is not None
        return self.epochs * steps_per_epoch(self.shard_rows(trainer), self.batch_size)

    def most_updates(self) -> int:
        """The most updates a server can apply in one run: a PULL for a later version
        would wait for ever, so the server refuses it."""
        targets = [self.target(t) for t in range(self.trainers)]
        return max(targets) if self.aggregate else sum(targets)

    def shard_rows(self, trainer: int) -> int:
        return sum(p.rows for p in plan([self.data.train_count], self.trainers)[trainer])

    def samples(self, trainer: int, clock: int) -> int:
        """Samples `trainer` has trained on after `clock` steps (the last batch of an epoch
        may be short)."""
        rows = self.shard_rows(trainer)
        epochs, rest = divmod(clock, steps_per_epoch(rows, self.batch_size))
        return epochs * rows + min(rest * self.batch_size, rows)


def parse(params: dict[str, str], world_size: int) -> MnistOptions:
    """Check every parameter and the data files; a ValueError names the field and cause."""
    check_known(JOB, params, KNOWN)
    servers = int_at_least(JOB, params, "ps", 1, minimum=1)
    if world_size < servers + 1:
        raise ValueError(
            f"{JOB} job: {world_size} members cannot hold ps={servers} servers and a trainer"
        )
    trainers = world_size - servers
    params = {"method": "bsp", **params}
    spec, on_loss = parse_barrier(JOB, params)
    num_steps, last_step = parse_stop(JOB, params, required=False)
    epochs = int_param(JOB, params, "epochs")
    if epochs is not None and (num_steps is not None or last_step is not None):
        raise ValueError(f"{JOB} job: give only one of epochs, num_steps and last_step")
    if epochs is None and num_steps is None and last_step is None:
        epochs = 5
    if epochs is not None and epochs < 1:
        raise ValueError(f"{JOB} job: parameter epochs must be >= 1, got {epochs}")
    name = params.get("optimizer", "sgd")
    if name not in ("sgd", "adam"):
        raise ValueError(f"{JOB} job: parameter optimizer={name!r} is not sgd or adam")
    lr = float_param(JOB, params, "lr", 0.02 if name == "sgd" else 0.001)
    if lr <= 0:
        raise ValueError(f"{JOB} job: parameter lr must be > 0, got {lr:g}")
    aggregate = _bool(params, "aggregate")
    if aggregate and spec.method != Method.BSP:
        raise ValueError(f"{JOB} job: parameter aggregate=true needs method=bsp, not {spec}")
    rule = default_rule(name, aggregate)
    if "update_rule" in params or "compensation" in params:
        compensation = float_param(JOB, params, "compensation", DEFAULT_COMPENSATION)
        try:
            rule = check_rule(params.get("update_rule", rule.name), compensation, name)
        except ValueError as exc:
            raise ValueError(f"{JOB} job: parameter {exc}") from None
    straggler, factor = parse_straggler(JOB, params, range(servers, world_size))
    data = parse_mnist(params.get("data", "digits"), field="data")
    check_train_shards(data, trainers)
    batch_size = int_at_least(JOB, params, "batch_size", default_batch(trainers), minimum=1)
    decay = float_param(JOB, params, "lr_decay", 0.7)
    if not 0 < decay <= 1:
        raise ValueError(f"{JOB} job: parameter lr_decay must be in (0, 1], got {decay:g}")
    return MnistOptions(
        data=data,
        servers=servers,
        trainers=trainers,
        spec=spec,
        on_loss=on_loss,
        epochs=epochs,
        num_steps=num_steps,
        last_step=last_step,
        batch_size=batch_size,
        optimizer=OptimizerSpec(
            name,
            lr,
            float_param(JOB, params, "momentum", 0.9),
            decay=decay,
            decay_every=_updates_per_epoch(data, trainers, batch_size, aggregate),
        ),
        rule=rule,
        aggregate=aggregate,
        straggler_rank=straggler,
        straggler_factor=factor,
        eval_seconds=float_param(JOB, params, "eval_seconds", 2.0) or 2.0,
        checkpoint_every=int_at_least(JOB, params, "checkpoint_every", 500, minimum=0),
        resume=_bool(params, "resume"),
        seed=int_at_least(JOB, params, "seed", 0, minimum=0),
        threads=int_at_least(JOB, params, "threads", 1, minimum=1),
        artifacts=artifacts_dir(JOB, params),
    )


def _updates_per_epoch(data: MnistSource, trainers: int, batch_size: int, aggregate: bool) -> int:
    """Server updates while every trainer makes one pass over its shard (the decay period)."""
    steps = [
        steps_per_epoch(sum(p.rows for p in pieces), batch_size)
        for pieces in plan([data.train_count], trainers)
    ]
    return max(steps) if aggregate else sum(steps)


def _bool(params: dict[str, str], name: str) -> bool:
    value = params.get(name, "false").lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"{JOB} job: parameter {name}={params[name]!r} is not true or false")
    return value in ("true", "1", "yes")


def initial_model(options: MnistOptions) -> MnistNet:
    """The same initial weights on every member (the servers' start)."""
    torch.manual_seed(options.seed)
    return MnistNet(options.data.rows, options.data.cols, CLASSES)
