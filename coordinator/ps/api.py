"""The public parameter-server API: any `torch.nn.Module`, split over `ps` servers.

Servers call `serve(model, ...)`, trainers `trainer(model, ...)` and then
`pull()` / `push()` (or `step(loss_fn)`). The layout is the model's
`named_parameters()` (buffers, e.g. batch norm's running stats, stay local to
each process), each tensor whole on one server, balanced by size; every party
builds it from the same model class, and a server refuses a trainer whose
layout digest differs.

The parties find each other through explicit, simple inputs: the job id and
round, the servers' addresses (`ServerAddress`) and the round's secret, which
every connection proves through the member endpoint's handshake
(`coordinator.rendezvous.handshake`) before a PS frame is read. Inside a member
(the `mnist` kind) these come from the `Member`; from a `command` program,
`program_peers()` derives them from the roster file and the job's roster in etcd
(read with the member's own etcd user), and each server listens on its member's
reserved port.

Gathered here from `serving` (a server), `training` (a trainer or reader) and `peers`
(who the parties are); `optimizer` checks and builds the servers' optimizer.
"""

from __future__ import annotations

# `X as X`: re-exported on purpose (`coordinator.ps` lists them in its `__all__`).
from coordinator.ps.client import ServerAddress as ServerAddress
from coordinator.ps.optim import OptimizerSpec
from coordinator.ps.peers import Peers as Peers
from coordinator.ps.peers import ProgramPeers as ProgramPeers
from coordinator.ps.peers import program_peers as program_peers
from coordinator.ps.serving import Server as Server
from coordinator.ps.serving import serve as serve
from coordinator.ps.training import Trainer as Trainer
from coordinator.ps.training import reader as reader
from coordinator.ps.training import trainer as trainer


def optimizer(
    name: str = "sgd",
    lr: float | None = None,
    *,
    momentum: float = 0.0,
    decay: float = 1.0,
    decay_every: int = 0,
) -> OptimizerSpec:
    """The servers' optimizer (torch's SGD or Adam, step for step); a ValueError names
    the bad argument. `lr` defaults to 0.02 (sgd) or 0.001 (adam)."""
    if name not in ("sgd", "adam"):
        raise ValueError(f"optimizer must be sgd or adam, not {name!r}")
    lr = (0.02 if name == "sgd" else 0.001) if lr is None else lr
    if not lr > 0:
        raise ValueError(f"optimizer lr must be > 0, got {lr:g}")
    if not 0 <= momentum < 1:
        raise ValueError(f"optimizer momentum must be in [0, 1), got {momentum:g}")
    if not 0 < decay <= 1:
        raise ValueError(f"optimizer decay must be in (0, 1], got {decay:g}")
    if decay_every < 0:
        raise ValueError(f"optimizer decay_every must be >= 0, got {decay_every}")
    return OptimizerSpec(name, lr, momentum, decay=decay, decay_every=decay_every)
