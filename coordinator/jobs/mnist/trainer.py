"""A trainer of the `mnist` job: its training loop, paced by the step barrier.

Each step: wait for its turn (the method's rule, on etcd), pull the weights, take the next
batch of its shard, compute the gradient, push it tagged with the version it came from,
publish its clock. A broken connection to a server is explained by the loss etcd reports.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch.nn import functional

from coordinator.barriers.live import LiveBarrier, OnLoss
from coordinator.barriers.policy import Method
from coordinator.datasets.mnist import Images
from coordinator.events import Step, emit
from coordinator.jobs.mnist.batches import batch_rows
from coordinator.jobs.mnist.members import LostMembers, member_rank, server_peers
from coordinator.jobs.mnist.options import MnistOptions, initial_model
from coordinator.ps import api as ps
from coordinator.ps.wire import ProtocolError
from coordinator.rendezvous.errors import MemberLost

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member


def train(
    member: Member, options: MnistOptions, shard: Images, lost: LostMembers
) -> dict[str, object]:
    """Train up to the trainer's target clock; its result record."""
    rank = member_rank(member)
    trainer = rank - options.servers
    model = initial_model(options)
    x, y = torch.from_numpy(shard.x), torch.from_numpy(shard.y)
    rows = len(shard.y)
    try:
        client = ps.trainer(
            model,
            server_peers(member, options.servers),
            index=trainer,
            timeout=member.timeout,
            wait_for_servers=False,  # they serve from `on_roster`: a refusal is a loss
        )
    except (OSError, ProtocolError) as exc:
        _explain(member, options, lost, exc)
    start, target = client.clock, options.target(trainer)
    slow = options.straggler_factor - 1 if options.straggler_rank == rank else 0.0
    barrier = LiveBarrier(
        member,
        options.spec,
        on_loss=options.on_loss,
        start_clock=start,
        participants=range(options.servers, options.servers + options.trainers),
    )
    passages: list[list[Any]] = []
    # Each step's time from the barrier letting it start to the next call of the barrier
    # (pull, compute, push, publishing the clock): the trace the simulator replays.
    step_seconds: list[float] = []
    # ASP takes the weights there are, and BSP-aggregate's next weights are this step's
    # averaged update: both may take them with the push, in one round trip.
    fused = options.aggregate or options.spec.method == Method.ASP
    fresh = False  # the model holds the weights the last push brought back
    waited = computed = 0.0
    reported = 0.0
    try:
        barrier.start()
        member.phase = "training"  # after the start barrier: failures name the phase
        began = time.time()
        while barrier.clock < target:
            passage = barrier.wait_turn()
            waited += passage.waited
            passages.append([passage.clock, passage.slowest])
            let_in = time.perf_counter()
            try:
                if not fresh:
                    client.pull()
                step_began = time.perf_counter()
                batch = batch_rows(options.seed, trainer, rows, options.batch_size, barrier.clock)
                client.zero_grad()
                loss = functional.cross_entropy(model(x[batch]), y[batch])
                loss.backward()
                compute = time.perf_counter() - step_began
                computed += compute
                if slow:
                    time.sleep(compute * slow)  # the straggler: its compute, made longer
                client.clock = barrier.clock  # the barrier's clock is the step's truth
                client.push(pull=fused)
                fresh = fused
            except (OSError, ProtocolError) as exc:
                _explain(member, options, lost, exc)
            barrier.complete()
            if time.monotonic() - reported > 0.5 or barrier.clock >= target:
                reported = time.monotonic()
                emit(Step(rank=rank, clock=barrier.clock, target=target, loss=loss.item()))
            step_seconds.append(round(time.perf_counter() - let_in, 6))
        try:
            client.close()
        except (OSError, ProtocolError) as exc:
            _explain(member, options, lost, exc)
        barrier.finish()
    finally:
        barrier.close()
        client.abort()
    client.flat.check_grads_in_place()
    member.etcd.put(member.keys.mnist_step_time(trainer), json.dumps(step_seconds))
    member.barrier("mnist-done")
    return {
        "role": "trainer",
        "rank": rank,
        "method": str(options.spec),
        "start_clock": start,
        "final_clock": barrier.clock,
        "target": target,
        "steps": barrier.clock - start,
        "wait_seconds": round(waited, 6),
        "compute_seconds": round(computed, 6),
        "began": began,
        "ended": time.time(),
        "passages": passages,
        "staleness": client.staleness,
        "lost": barrier.counters.lost,
        "shard": {"rows": [shard.rows.start, shard.rows.stop], "digest": shard.digest},
    }


def _explain(
    member: Member, options: MnistOptions, lost: LostMembers, error: Exception
) -> NoReturn:
    """A connection to a server broke: name the member whose loss broke it, if etcd
    can tell within a lease TTL (the one lost first: a server that failed because a
    trainer died is not the cause)."""
    deadline = time.monotonic() + member.ttl + 2.0
    while True:
        losses = dict(lost.reasons)
        servers = [r for r in losses if r < options.servers]
        if servers or (losses and options.on_loss == OnLoss.FAIL):
            rank = servers[0] if options.on_loss == OnLoss.CONTINUE else next(iter(losses))
            raise MemberLost(rank, "training", f"{losses[rank]}; connection: {error}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"a parameter server connection failed: {error}") from error
        lost.reported.wait(remaining)  # the next loss etcd reports
        lost.reported.clear()
