"""One member's side of the `mnist` job: it serves (rank < ps) or trains.

Before connecting (`on_roster`) a server starts serving on its roster endpoint and server 0
loads the test set; a trainer loads only its own shard. `run` then hands over to the
server's side (`server.serve`) or the trainer's loop (`trainer.train`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from coordinator.barriers.live import OnLoss
from coordinator.datasets.mnist import Images, load_test, load_train_shard
from coordinator.jobs.mnist import server as server_side
from coordinator.jobs.mnist.members import LostMembers, member_rank, server_peers
from coordinator.jobs.mnist.options import initial_model, parse
from coordinator.jobs.mnist.trainer import train
from coordinator.ps import api as ps

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member


class MnistJob:
    """One member's side of the job: a server (rank < ps) or a trainer."""

    def __init__(self, params: dict[str, str], world_size: int) -> None:
        self.options = parse(params, world_size)
        self.world_size = world_size
        self.server: ps.Server | None = None
        self.shard: Images | None = None
        self.test: Images | None = None
        self.lost = LostMembers()

    def on_roster(self, member: Member) -> None:
        rank = member_rank(member)
        options = self.options
        torch.set_num_threads(options.threads)
        member.on_member_lost(self._on_member_lost)
        if options.on_loss == OnLoss.CONTINUE:
            member.carry_on_without_lost()
        if rank < options.servers:
            folder = options.artifacts / member.job_id
            self.server = ps.serve(
                initial_model(options),
                index=rank,
                servers=options.servers,
                trainers=options.trainers,
                peers=server_peers(member, options.servers),
                optimizer=options.optimizer,
                update_rule=options.rule.name,
                compensation=options.rule.compensation,
                aggregate=options.aggregate,
                checkpoint_dir=folder / "checkpoint",
                checkpoint_every=options.checkpoint_every,
                resume=options.resume,
                max_updates=options.most_updates(),
            )
            # A connection may be quiet for as long as training may stall (the phase
            # timeout) or between two evaluations (server 0 reading the others).
            quiet = max(member.timeout, 2 * options.eval_seconds + member.ttl)
            member.serve(self.server.handle, idle_timeout=quiet)
            if rank == 0:
                self.test = load_test(options.data)
        else:
            self.shard = load_train_shard(options.data, rank - options.servers, options.trainers)

    def _on_member_lost(self, rank: int, reason: str) -> None:
        self.lost.record(rank, reason)
        if self.server is not None:
            with self.server.core.changed:
                self.server.core.changed.notify_all()

    def run(self, member: Member) -> dict[str, object]:
        if self.server is not None:
            return server_side.serve(member, self.options, self.server, self.test, self.lost)
        assert self.shard is not None
        return train(member, self.options, self.shard, self.lost)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
