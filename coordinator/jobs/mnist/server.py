"""A parameter server of the `mnist` job: serve until every trainer is done, then record.

It serves from `on_roster` (`MnistJob`); here it passes the start barrier with the
trainers, waits for each trainer's goodbye while acting on the losses etcd reports, then
checkpoints and writes its staleness log. Server 0 also evaluates the model
(`Evaluator`) and, once everyone is done, writes the job's results (`write_results`).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from coordinator.barriers.live import OnLoss
from coordinator.datasets.mnist import Images
from coordinator.jobs.mnist.evaluation import Evaluator
from coordinator.jobs.mnist.members import LostMembers, member_rank
from coordinator.jobs.mnist.options import MnistOptions
from coordinator.jobs.mnist.results import write_results
from coordinator.ps import api as ps
from coordinator.rendezvous.errors import MemberLost, RendezvousTimeout

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member


def serve(
    member: Member,
    options: MnistOptions,
    server: ps.Server,
    test: Images | None,
    lost: LostMembers,
) -> dict[str, object]:
    """Serve the trainers to the end; this server's result record (server 0's with the
    summary's paths and the test metrics)."""
    rank = member_rank(member)
    member.barrier("steps-start")  # the trainers' start barrier: everyone begins together
    member.phase = "training"
    began = time.time()
    evaluator = None
    if rank == 0:
        assert test is not None
        evaluator = Evaluator(options, member, server, test, began)
    try:
        _wait_for_trainers(member, options, server, lost)
        ended = time.time()  # training time: the final evaluation is not part of it
        if evaluator is not None:
            evaluator.stop()
    finally:
        if evaluator is not None:
            evaluator.close()
        server.close()
    server.save_checkpoint()
    folder = options.artifacts / member.job_id
    server.write_staleness_log(folder / f"staleness-{rank}.csv", options.servers)
    histogram = server.staleness_histogram()
    record = {
        "server": rank,
        "version": server.version,
        "resumed_from": server.resumed_from,
        "staleness_histogram": histogram,
        "clocks": {t: s.clock for t, s in server.core.trainers.items()},
    }
    member.etcd.put(member.keys.mnist_server(rank), json.dumps(record))
    member.barrier("mnist-done")
    result: dict[str, object] = {"role": "server", "rank": rank, **record}
    if evaluator is not None:
        result |= write_results(member, options, server, evaluator, lost, began, ended)
    return result


def _wait_for_trainers(
    member: Member, options: MnistOptions, public: ps.Server, lost: LostMembers
) -> None:
    """Until every trainer said BYE (or was excused); act on a loss at once (the
    member's view of losses: `ps.Server.wait` knows only connections)."""
    server = public.core
    losses = lost.reasons
    idle_since, version = time.monotonic(), -1
    with server.changed:
        while not server.done():
            lost_servers = [r for r in losses if r < options.servers]
            if lost_servers or (losses and options.on_loss == OnLoss.FAIL):
                rank = lost_servers[0] if lost_servers else next(iter(losses))
                raise MemberLost(rank, "training", losses[rank])
            for rank in losses:
                if rank >= options.servers:
                    server.excuse(rank - options.servers)
            broken = server.broken()
            if broken:  # a trainer's connection ended: etcd will say why within a TTL
                trainer, reason = next(iter(broken.items()))
                if time.monotonic() - idle_since > member.ttl + 2.0:
                    raise RuntimeError(
                        f"trainer rank {trainer + options.servers}'s connection broke "
                        f"({reason}) but etcd does not report it lost"
                    )
            if server.version != version:
                idle_since, version = time.monotonic(), server.version
            remaining = idle_since + member.timeout - time.monotonic()
            if remaining <= 0:
                waiting = [
                    t + options.servers for t, s in server.trainers.items() if not s.finished
                ]
                raise RendezvousTimeout("training", member.timeout, waiting)
            server.changed.wait(min(remaining, member.ttl + 2.0))
