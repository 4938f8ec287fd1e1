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
"""

from __future__ import annotations

import csv
import io
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from coordinator.files import write_private
from coordinator.ps.client import ServerAddress, ServerLinks
from coordinator.ps.model import FlatModel, server_tensors
from coordinator.ps.optim import OptimizerSpec
from coordinator.ps.server import Applied, ParameterServer
from coordinator.rendezvous.endpoint import MemberEndpoint


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


@dataclass(frozen=True)
class Peers:
    """Who the parties of one job's parameter server are, and what proves it."""

    job_id: str
    round: int
    servers: list[ServerAddress]  # by server index (= rank: servers are ranks 0..ps-1)
    secret: bytes | None  # the round's secret; None only for a server behind no handshake

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("peers: at least one server address is needed")
        if [s.rank for s in self.servers] != list(range(len(self.servers))):
            raise ValueError("peers: servers must be given in index order 0..ps-1")


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
    aggregate: bool = False,
    checkpoint_dir: Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    max_updates: int | None = None,
) -> Server:
    """Server `index` of `servers`, for `trainers` trainers, starting from `model`'s
    weights (every server must build the same initial model: seed it).

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
    checkpoint = None if checkpoint_dir is None else Path(checkpoint_dir) / f"server-{index}.pt"
    core = ParameterServer(
        job_id=peers.job_id if peers else "local",
        round_=peers.round if peers else 0,
        index=index,
        tensors=server_tensors(model, servers, index),
        trainers=trainers,
        optimizer=optimizer or OptimizerSpec("sgd", 0.02),
        aggregate=aggregate,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        resume=resume,
        max_updates=max_updates,
    )
    return Server(core)


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


@dataclass(frozen=True)
class ProgramPeers:
    """What a `command` program needs for the parameter server, from its environment."""

    rank: int
    world_size: int
    peers: Peers
    bind: tuple[str, int]  # this member's address and reserved port (a server listens there)
    checkpoint_dir: Path  # <artifacts>/<job>/ps: private, kept across attempts


def program_peers(servers: int, *, environ: dict[str, str] | None = None) -> ProgramPeers:
    """The PS peers of a program run by `coordinator run` (ranks < `servers` serve): the
    servers' addresses and reserved ports from the roster file (COORDINATOR_ROSTER), the
    round's secret from the job's roster in etcd, read with the member's own etcd user
    (COORDINATOR_ETCD, COORDINATOR_NAMESPACE and the COORDINATOR_ETCD_* settings). Each
    server's handshake identity is its member's id with "/ps" appended, so a PS key never
    opens the member's own endpoint."""
    from coordinator.etcd.client import Etcd
    from coordinator.keys import JobKeys, job_path
    from coordinator.rendezvous.member import read_roster
    from coordinator.rendezvous.roster import RosterFile

    env = dict(os.environ if environ is None else environ)
    missing = [v for v in ("COORDINATOR_ROSTER", "COORDINATOR_RANK", "COORDINATOR_ETCD")
               if not env.get(v)]  # fmt: skip
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not set: run this program under `coordinator run "
            "--workers N -- PROGRAM` (the command kind)"
        )
    document = RosterFile.model_validate_json(Path(env["COORDINATOR_ROSTER"]).read_bytes())
    job_id, round_, members = document.job_id, document.round, document.members
    if not 1 <= servers < len(members):
        raise ValueError(f"ps={servers}: {len(members)} members need 1..{len(members) - 1}")
    etcd = Etcd(
        env["COORDINATOR_ETCD"],
        namespace=env.get("COORDINATOR_NAMESPACE", "/coordinator"),
        probe=job_path(job_id),
    )
    try:
        kv = etcd.get(JobKeys(etcd.namespace, job_id).roster)
    finally:
        etcd.close()
    if kv is None:
        raise RuntimeError(f"job {job_id}'s roster is not in etcd (the job ended?)")
    roster = read_roster(kv.value)
    if (roster.job_id, roster.round) != (job_id, round_):
        raise RuntimeError("the roster in etcd is of another round than the roster file")
    addresses = [
        ServerAddress(
            rank,
            members[rank].address,
            members[rank].reserved_ports[0],
            f"{roster.members[rank].member_id}/ps",
        )
        for rank in range(servers)
    ]
    rank = int(env["COORDINATOR_RANK"])
    me = members[rank]
    artifacts = Path(env.get("COORDINATOR_ARTIFACTS", "artifacts"))
    return ProgramPeers(
        rank=rank,
        world_size=len(members),
        peers=Peers(job_id, round_, addresses, roster.secret_bytes),
        bind=(me.address, me.reserved_ports[0]),
        checkpoint_dir=artifacts / "ps",
    )
