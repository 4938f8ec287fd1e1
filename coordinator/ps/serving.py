"""A parameter server as a program holds it: `serve(model, ...)` and the `Server` handle.

The handle wraps one `ParameterServer` (the protocol, `coordinator.ps.server`): it serves
through a member's endpoint or one of its own (`listen`), waits for the trainers, and
writes what they left (checkpoint, staleness log).
"""

from __future__ import annotations

import csv
import io
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from coordinator.files import write_private
from coordinator.ps.checkpoints import Checkpoints
from coordinator.ps.model import server_tensors
from coordinator.ps.optim import OptimizerSpec
from coordinator.ps.peers import Peers
from coordinator.ps.rules import DEFAULT_COMPENSATION, check_rule, default_rule
from coordinator.ps.server import Applied, ParameterServer
from coordinator.rendezvous.endpoint import MemberEndpoint


class Server:
    """One server's share of `model`, updated by the trainers' gradients.

    `handle` serves one connection that passed the handshake: hand it to a member's
    endpoint (`member.serve(server.handle)`), or let `listen` open an endpoint of its own.
    """

    def __init__(self, core: ParameterServer) -> None:
        self.core = core
        self.endpoint: MemberEndpoint | None = None

    @property
    def handle(self) -> Callable[[socket.socket], None]:
        return self.core.handle

    @property
    def version(self) -> int:
        """Updates applied so far (counting those before a resume)."""
        return self.core.version

    @property
    def resumed_from(self) -> int | None:
        """The checkpoint's version this run resumed from (None: a fresh start)."""
        return self.core.resumed_from

    @property
    def log(self) -> list[Applied]:
        """The staleness log: one row per gradient applied."""
        return self.core.log

    def listen(
        self, host: str, port: int, peers: Peers, *, idle_timeout: float = 300.0
    ) -> MemberEndpoint:
        """Accept trainers on `host:port` (a command program's reserved port), admitting
        only callers that prove the round's secret for this server's address."""
        if peers.secret is None:
            raise ValueError("listen: a server listening by itself needs the round's secret")
        address = peers.servers[self.core.index]
        endpoint = MemberEndpoint(peers.job_id, address.member_id, host, port)
        endpoint.idle_timeout = idle_timeout
        endpoint.handler = self.core.handle
        endpoint.authorize(peers.secret, peers.round)
        self.endpoint = endpoint
        return endpoint

    def wait(self, timeout: float | None = None, *, idle: float | None = None) -> None:
        """Until every trainer said goodbye (or was excused). TimeoutError after `timeout`
        seconds in all, or after `idle` seconds without an update; RuntimeError when a
        trainer's connection broke without goodbye (it died)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        core = self.core
        idle_since, version = time.monotonic(), core.version
        with core.changed:
            while not core.done():
                broken = core.broken()
                if broken:
                    trainer, reason = next(iter(broken.items()))
                    raise RuntimeError(f"trainer {trainer}'s connection broke: {reason}")
                if core.version != version:
                    idle_since, version = time.monotonic(), core.version
                limits = [1.0]
                if deadline is not None:
                    limits.append(deadline - time.monotonic())
                if idle is not None:
                    limits.append(idle_since + idle - time.monotonic())
                if min(limits) <= 0:
                    waiting = [t for t, s in core.trainers.items() if not s.finished]
                    raise TimeoutError(f"trainers {waiting} did not finish in time")
                core.changed.wait(min(limits))

    def excuse(self, trainer: int) -> None:
        """Go on without a lost trainer (aggregate steps stop waiting for it)."""
        self.core.excuse(trainer)

    def snapshot(self) -> tuple[torch.Tensor, int]:
        """A copy of this server's share (flat) and its version."""
        return self.core.snapshot()

    def staleness_histogram(self) -> dict[int, int]:
        return self.core.staleness_histogram()

    def save_checkpoint(self) -> None:
        self.core.save_checkpoint()

    def write_staleness_log(self, path: Path, rank_offset: int = 0) -> None:
        """The staleness log as CSV (trainer ranks = index + `rank_offset`), written whole
        under a temporary name first, private to its owner."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        text = io.StringIO(newline="")
        writer = csv.writer(text)
        writer.writerow(["trainer_rank", "clock", "computed_from", "applied_at", "staleness", "t"])
        for row in self.core.log:
            writer.writerow(
                [row.trainer + rank_offset, row.clock, row.computed_from,
                 row.applied_at, row.staleness, f"{row.t:.6f}"]
            )  # fmt: skip
        write_private(path, text.getvalue())

    def close(self, grace: float = 5.0) -> None:
        """Stop serving: waiting pulls and aggregate steps end; the endpoint closes, and
        its connections' threads are given `grace` seconds to end (a process that exits
        under a thread still in the handler can abort)."""
        self.core.close()
        if self.endpoint is not None:
            self.endpoint.close()
            deadline = time.monotonic() + grace
            while self.endpoint.active and time.monotonic() < deadline:
                time.sleep(0.01)  # bounded poll: the endpoint signals no thread's end


def serve(
    model: nn.Module,
    *,
    index: int,
    servers: int,
    trainers: int,
    peers: Peers | None = None,
    optimizer: OptimizerSpec | None = None,
    update_rule: str | None = None,
    compensation: float = DEFAULT_COMPENSATION,
    aggregate: bool = False,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    max_updates: int | None = None,
) -> Server:
    """Server `index` of `servers`, for `trainers` trainers, starting from `model`'s
    weights (every server must build the same initial model: seed it).

    - `update_rule`: how a gradient becomes a step (`coordinator.ps.rules`): `plain`,
      `scaled` (the default with SGD and `aggregate`), `async` (the default otherwise
      with SGD), `staleness` or `dc` (`compensation`: its lambda).
    - `aggregate`: each step's gradients of every live trainer are averaged into one
      update, and each push waits for it (synchronous SGD, for BSP).
    - `checkpoint_dir`: every `checkpoint_every` updates the share, the optimizer state,
      the version and the trainers' clocks go to `server-<index>.pt` there; `resume`
      continues from that file when it exists.
    - `max_updates`: the most updates this run can apply; a pull waiting for a later
      version is refused instead of waiting for ever.
    - `peers`: given, the server is for that job and round; without it, `job_id` "local"
      and round 0 (then trainers must say the same).
    """
    if not 0 <= index < servers:
        raise ValueError(f"serve: index {index} is not one of the {servers} servers")
    if trainers < 1:
        raise ValueError(f"serve: trainers must be >= 1, got {trainers}")
    if checkpoint_every < 0:
        raise ValueError(f"serve: checkpoint_every must be >= 0, got {checkpoint_every}")
    optimizer = optimizer or OptimizerSpec("sgd", 0.02)
    try:
        rule = (
            default_rule(optimizer.name, aggregate)
            if update_rule is None
            else check_rule(update_rule, compensation, optimizer.name)
        )
    except ValueError as exc:
        raise ValueError(f"serve: {exc}") from None
    checkpoints = None
    if checkpoint_dir is not None:
        path = Path(checkpoint_dir) / f"server-{index}.pt"
        checkpoints = Checkpoints(path, every=checkpoint_every, resume=resume)
    core = ParameterServer(
        job_id=peers.job_id if peers else "local",
        round_=peers.round if peers else 0,
        index=index,
        tensors=server_tensors(model, servers, index),
        trainers=trainers,
        optimizer=optimizer,
        rule=rule,
        aggregate=aggregate,
        checkpoints=checkpoints,
        max_updates=max_updates,
    )
    return Server(core)
