"""A trainer's (or a reader's) side of the parameter server: `trainer()`, `reader()` and the
`Trainer` they return, which pulls weights into a model and pushes its gradients."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from coordinator.ps.client import ServerAddress, ServerLinks
from coordinator.ps.model import FlatModel
from coordinator.ps.peers import Peers


class Trainer:
    """A trainer's (or, with `index=None`, a reader's) links to every server.

    `model`'s parameters and gradients are moved into one flat buffer each: `pull`
    writes the servers' weights straight into the model, `push` sends the gradients
    autograd left in `.grad`. Keep using the same model object; do not replace a
    parameter's `.grad` (zero it in place: `zero_grad()` here, or `step`).
    """

    def __init__(
        self,
        model: nn.Module,
        peers: Peers,
        *,
        index: int | None,
        timeout: float = 30.0,
        only: Sequence[int] | None = None,
        wait_for_servers: bool = True,
    ) -> None:
        self.model = model
        self.flat = FlatModel.build(model, len(peers.servers))
        if only is not None and index is not None:
            raise ValueError("only: a trainer talks to every server; only a reader may skip")
        linked = peers.servers if only is None else [peers.servers[i] for i in only]
        patience = timeout if wait_for_servers else 0.0
        self.links = _connect(self.flat, linked, peers, index, timeout, patience)
        #: Steps this trainer has pushed (from the servers' record after a resume).
        self.clock = min(self.links.clocks, default=0)
        self.staleness: dict[int, int] = {}  # staleness -> gradients the servers recorded

    def pull(self) -> list[int]:
        """The current weights into the model; each server's version."""
        return self.links.pull()

    def pull_at_least(self, versions: list[int]) -> list[int]:
        """Like `pull`, once each server reached at least that version (bounded delay)."""
        return self.links.pull(versions)

    @property
    def versions(self) -> list[int]:
        """The servers' versions at the last pull (what the next push is computed from)."""
        return list(self.links.versions)

    def push(
        self, grads: Iterable[torch.Tensor | None] | None = None, *, pull: bool = False
    ) -> list[int]:
        """Send this step's gradients (the model's `.grad`, or `grads` in the order of
        `model.parameters()`), advancing the clock; the staleness each server recorded.
        Under `aggregate` it returns once the step's averaged update is applied.
        `pull`: then the current weights into the model, in the same round trip (one
        request per server instead of two; they include this gradient)."""
        if grads is not None:
            params = list(self.model.parameters())
            given = list(grads)
            if len(given) != len(params):
                raise ValueError(f"push: {len(given)} gradients for {len(params)} parameters")
            for param, grad in zip(params, given, strict=True):
                target = param.grad
                assert target is not None  # FlatModel set it
                if grad is None:
                    target.zero_()
                elif grad.shape != param.shape:
                    raise ValueError(f"push: a gradient of shape {list(grad.shape)} for a "
                                     f"parameter of shape {list(param.shape)}")  # fmt: skip
                elif grad.data_ptr() != target.data_ptr():
                    target.copy_(grad)
        self.flat.check_grads_in_place()
        self.clock += 1
        recorded = self.links.push_pull(self.clock) if pull else self.links.push(self.clock)
        for value in recorded:
            self.staleness[value] = self.staleness.get(value, 0) + 1
        return recorded

    def zero_grad(self) -> None:
        """Zero every gradient in place, in one call on the flat buffer."""
        self.flat.grads.zero_()

    def step(self, loss_fn: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
        """Pull, zero the gradients, `loss_fn(model).backward()`, push; the loss."""
        self.pull()
        self.zero_grad()
        loss = loss_fn(self.model)
        loss.backward()
        self.push()
        return loss.detach()

    def close(self) -> None:
        """Say goodbye to every server (a trainer that closes without it counts as lost),
        then close the connections."""
        try:
            if self.links.socks:
                self.links.bye()
        finally:
            self.links.close()

    def abort(self) -> None:
        """Close the connections without goodbye."""
        self.links.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
        else:
            self.abort()


def _connect(
    flat: FlatModel,
    linked: list[ServerAddress],
    peers: Peers,
    index: int | None,
    timeout: float,
    patience: float,
) -> ServerLinks:
    """Links to `linked`, retrying a refused connection for `patience` seconds: in a
    program, a server may start listening after its trainers start (nothing orders them)."""
    deadline = time.monotonic() + patience
    pause = 0.02
    while True:
        try:
            return ServerLinks(
                flat,
                linked,
                job_id=peers.job_id,
                round_=peers.round,
                trainer=index,
                timeout=timeout,
                secret=peers.secret,
            )
        except ConnectionRefusedError:
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)  # a retry's back-off, not synchronisation
            pause = min(pause * 2, 0.5)


def trainer(
    model: nn.Module,
    peers: Peers,
    *,
    index: int,
    timeout: float = 30.0,
    wait_for_servers: bool = True,
) -> Trainer:
    """Trainer `index` (0-based among the trainers) of the job `peers` names. A server
    that refuses the connection is retried for `timeout` seconds (`wait_for_servers`:
    off where the servers listen before trainers start, so a dead one fails at once)."""
    return Trainer(model, peers, index=index, timeout=timeout, wait_for_servers=wait_for_servers)


def reader(
    model: nn.Module, peers: Peers, *, timeout: float = 30.0, only: Sequence[int] | None = None
) -> Trainer:
    """Pull-only links (an evaluator): it may pull, never push; `only` these servers (a
    server reading the others takes its own share from memory: `Server.snapshot`)."""
    return Trainer(model, peers, index=None, timeout=timeout, only=only, wait_for_servers=False)
