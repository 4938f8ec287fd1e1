"""The `mnist` job: parameter-server training of `MnistNet`, paced by the step barriers.

Ranks `0..ps-1` are parameter servers; the others are trainers. The model's
tensors are split across the servers whole, balanced by size.

- **Before joining**, every member checks the parameters and the data files
  (magic numbers, counts, that every trainer gets rows), and that PyTorch is
  installed: bad input exits 2 on every member with nothing written to etcd.
- **After `ip_exchange`** (`on_roster`) each server starts serving on its roster
  endpoint; server 0 loads the test set, each trainer only its own shard.
- **Training.** Everyone passes the `steps-start` barrier together. A trainer
  loops: wait for its turn (the method's rule, on etcd), pull the weights, take
  the next batch of its shard, compute the gradient, push it tagged with the
  version it came from, publish its clock. A straggler sleeps its compute time
  times `straggler_factor - 1` more. Server 0 evaluates the whole model on the
  test set every `eval_seconds` and writes `<job>/mnist/metrics/<n>`.
- **Loss.** A trainer that dies breaks its connections: the servers notice at
  once and, after etcd names it (within the lease TTL), fail with `MemberLost`,
  or with `on_loss=continue` go on without it. A server that dies breaks the
  trainers' connections: they fail with `MemberLost` naming it.
- **Results.** Rank 0 saves `<artifacts>/<job>/model.pt` (a state_dict of
  `MnistNet`) and `summary.json`; every server writes its staleness log
  `staleness-<server>.csv`. Servers checkpoint every `checkpoint_every`
  updates; `resume=true` continues from there.

Stop conditions (seed 000): `epochs` passes over each trainer's shard (default
5), `num_steps` steps per trainer, or `last_step`, an absolute clock; all count
from the job's start, so a resumed trainer does only what is left.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch.nn import functional

from coordinator.barriers.live import LiveBarrier, OnLoss
from coordinator.barriers.policy import BarrierSpec, Method
from coordinator.datasets.mnist import (
    Images,
    MnistSource,
    check_train_shards,
    load_test,
    load_train_shard,
    parse_mnist,
)
from coordinator.datasets.shards import plan
from coordinator.events import Metrics, Step, emit
from coordinator.files import replacing
from coordinator.jobs import catalog
from coordinator.jobs.params import artifacts_dir, check_known, float_param, int_param
from coordinator.jobs.steps import parse_barrier, parse_stop, parse_straggler
from coordinator.keys import rank_of
from coordinator.ps import api as ps
from coordinator.ps.model import MnistNet
from coordinator.ps.optim import OptimizerSpec
from coordinator.ps.wire import ProtocolError
from coordinator.rendezvous.errors import MemberLost, RendezvousTimeout

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member

JOB = "mnist"
CLASSES = 10

KNOWN = catalog.names(catalog.MNIST)


@dataclass(frozen=True)
class MnistOptions:
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


def parse(params: dict[str, str], world_size: int) -> MnistOptions:
    """Check every parameter and the data files; a ValueError names the field and cause."""
    check_known(JOB, params, KNOWN)
    servers = _positive(params, "ps", 1)
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
    straggler, factor = parse_straggler(JOB, params, range(servers, world_size))
    data = parse_mnist(params.get("data", "digits"), field="data")
    check_train_shards(data, trainers)
    batch_size = _positive(params, "batch_size", 32)
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
        aggregate=aggregate,
        straggler_rank=straggler,
        straggler_factor=factor,
        eval_seconds=float_param(JOB, params, "eval_seconds", 2.0) or 2.0,
        checkpoint_every=_non_negative(params, "checkpoint_every", 500),
        resume=_bool(params, "resume"),
        seed=_non_negative(params, "seed", 0),
        threads=_positive(params, "threads", 1),
        artifacts=artifacts_dir(JOB, params),
    )


def _updates_per_epoch(data: MnistSource, trainers: int, batch_size: int, aggregate: bool) -> int:
    """Server updates while every trainer makes one pass over its shard (the decay period)."""
    steps = [
        steps_per_epoch(sum(p.rows for p in pieces), batch_size)
        for pieces in plan([data.train_count], trainers)
    ]
    return max(steps) if aggregate else sum(steps)


def _positive(params: dict[str, str], name: str, default: int) -> int:
    value = _non_negative(params, name, default)
    if value < 1:
        raise ValueError(f"{JOB} job: parameter {name} must be >= 1, got {value}")
    return value


def _non_negative(params: dict[str, str], name: str, default: int) -> int:
    value = int_param(JOB, params, name, default)
    assert value is not None
    if value < 0:
        raise ValueError(f"{JOB} job: parameter {name} must be >= 0, got {value}")
    return value


def _bool(params: dict[str, str], name: str) -> bool:
    value = params.get(name, "false").lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"{JOB} job: parameter {name}={params[name]!r} is not true or false")
    return value in ("true", "1", "yes")


def steps_per_epoch(rows: int, batch_size: int) -> int:
    return math.ceil(rows / batch_size)


@lru_cache(maxsize=2)
def _epoch_order(seed: int, trainer: int, rows: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + trainer * 7_919 + epoch)
    return torch.randperm(rows, generator=generator)


def batch_rows(seed: int, trainer: int, rows: int, batch_size: int, step: int) -> torch.Tensor:
    """Which rows of its shard `trainer` trains on at `step` (0-based): a fresh seeded
    shuffle each epoch, cut into batches. A pure function of the step, so a resumed
    trainer takes up the data order exactly where the checkpoint left it."""
    epoch, position = divmod(step, steps_per_epoch(rows, batch_size))
    order = _epoch_order(seed, trainer, rows, epoch)
    return order[position * batch_size : (position + 1) * batch_size]


def initial_model(options: MnistOptions) -> MnistNet:
    """The same initial weights on every member (the servers' start)."""
    torch.manual_seed(options.seed)
    return MnistNet(options.data.rows, options.data.cols, CLASSES)


class MnistJob:
    """One member's side of the job: a server (rank < ps) or a trainer."""

    def __init__(self, params: dict[str, str], world_size: int) -> None:
        self.options = parse(params, world_size)
        self.world_size = world_size
        self.server: ps.Server | None = None
        self.shard: Images | None = None
        self.test: Images | None = None
        self._losses: dict[int, str] = {}  # rank -> reason, in the order etcd reported them
        self._lost_event = threading.Event()

    @property
    def trainer_ranks(self) -> range:
        return range(self.options.servers, self.world_size)

    # -- before connect ---------------------------------------------------

    def on_roster(self, member: Member) -> None:
        rank = _rank(member)
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
                peers=self._peers(member),
                optimizer=options.optimizer,
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
        self._losses.setdefault(rank, reason)
        self._lost_event.set()
        if self.server is not None:
            with self.server.core.changed:
                self.server.core.changed.notify_all()

    # -- training ---------------------------------------------------------

    def run(self, member: Member) -> dict[str, object]:
        if self.server is not None:
            return self._serve(member, self.server)
        return self._train(member)

    def _peers(self, member: Member) -> ps.Peers:
        """The servers are the first `ps` members, at their roster endpoints."""
        if member.roster is None:
            raise RuntimeError("the member holds no roster")
        servers = [
            ps.ServerAddress(m.rank, m.host, m.port, m.member_id)
            for m in member.roster.members[: self.options.servers]
        ]
        return ps.Peers(member.job_id, member.round, servers, member.roster.secret_bytes)

    def _train(self, member: Member) -> dict[str, object]:
        options, shard = self.options, self.shard
        assert shard is not None
        rank = _rank(member)
        trainer = rank - options.servers
        torch.manual_seed(options.seed)
        model = MnistNet(options.data.rows, options.data.cols, CLASSES)
        x, y = torch.from_numpy(shard.x), torch.from_numpy(shard.y)
        rows = len(shard.y)
        try:
            client = ps.trainer(
                model,
                self._peers(member),
                index=trainer,
                timeout=member.timeout,
                wait_for_servers=False,  # they serve from `on_roster`: a refusal is a loss
            )
        except (OSError, ProtocolError) as exc:
            self._explain(member, exc)
        start, target = client.clock, options.target(trainer)
        slow = options.straggler_factor - 1 if options.straggler_rank == rank else 0.0
        barrier = LiveBarrier(
            member,
            options.spec,
            on_loss=options.on_loss,
            start_clock=start,
            participants=self.trainer_ranks,
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
                    batch = batch_rows(
                        options.seed, trainer, rows, options.batch_size, barrier.clock
                    )
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
                    self._explain(member, exc)
                barrier.complete()
                if time.monotonic() - reported > 0.5 or barrier.clock >= target:
                    reported = time.monotonic()
                    emit(Step(rank=rank, clock=barrier.clock, target=target, loss=loss.item()))
                step_seconds.append(round(time.perf_counter() - let_in, 6))
            try:
                client.close()
            except (OSError, ProtocolError) as exc:
                self._explain(member, exc)
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

    def _explain(self, member: Member, error: Exception) -> NoReturn:
        """A connection to a server broke: name the member whose loss broke it, if etcd
        can tell within a lease TTL (the one lost first: a server that failed because a
        trainer died is not the cause)."""
        deadline = time.monotonic() + member.ttl + 2.0
        while True:
            losses = dict(self._losses)
            servers = [r for r in losses if r < self.options.servers]
            if servers or (losses and self.options.on_loss == OnLoss.FAIL):
                rank = servers[0] if self.options.on_loss == OnLoss.CONTINUE else next(iter(losses))
                raise MemberLost(rank, "training", f"{losses[rank]}; connection: {error}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"a parameter server connection failed: {error}") from error
            self._lost_event.wait(remaining)  # the next loss etcd reports
            self._lost_event.clear()

    # -- the server's side ----------------------------------------------------

    def _serve(self, member: Member, server: ps.Server) -> dict[str, object]:
        options = self.options
        rank = _rank(member)
        member.barrier("steps-start")  # the trainers' start barrier: everyone begins together
        member.phase = "training"
        began = time.time()
        evaluator = Evaluator(self, member, server, began) if rank == 0 else None
        try:
            self._wait_for_trainers(member, server)
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
            result |= self._finish(member, evaluator, began, ended)
        return result

    def _wait_for_trainers(self, member: Member, public: ps.Server) -> None:
        """Until every trainer said BYE (or was excused); act on a loss at once (the
        member's view of losses: `ps.Server.wait` knows only connections)."""
        options, server = self.options, public.core
        idle_since, version = time.monotonic(), -1
        with server.changed:
            while not server.done():
                lost_servers = [r for r in self._losses if r < options.servers]
                if lost_servers or (self._losses and options.on_loss == OnLoss.FAIL):
                    rank = lost_servers[0] if lost_servers else next(iter(self._losses))
                    raise MemberLost(rank, "training", self._losses[rank])
                for rank in self._losses:
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

    def _finish(
        self, member: Member, evaluator: Evaluator, began: float, ended: float
    ) -> dict[str, object]:
        """Rank 0, after everyone is done: the model file and the summary."""
        options = self.options
        folder = options.artifacts / member.job_id
        records = [
            json.loads(kv.value) for kv in member.etcd.get_prefix(member.keys.mnist_servers)[0]
        ]
        histogram: dict[int, int] = {}
        clocks: dict[int, int] = {}
        for record in records:
            for staleness, count in record["staleness_histogram"].items():
                histogram[int(staleness)] = histogram.get(int(staleness), 0) + count
            for trainer, clock in record["clocks"].items():
                clocks[int(trainer) + options.servers] = clock
        starts = {r["server"]: r["resumed_from"] for r in records}
        step_times = self._write_step_times(member, folder / "step_times.csv")
        assert self.server is not None
        samples = sum(
            self._samples(t, clock) - self._samples(t, self.server.core.start_clocks[t])
            for t, clock in ((rank - options.servers, c) for rank, c in clocks.items())
        )
        final = evaluator.final
        path = folder / "model.pt"
        with replacing(path) as partial:
            torch.save(evaluator.model.state_dict(), partial)
        seconds = max(ended - began, 1e-9)
        summary = {
            "job": member.job_id,
            "method": str(options.spec),
            "aggregate": options.aggregate,
            "servers": options.servers,
            "trainers": options.trainers,
            "batch_size": options.batch_size,
            "optimizer": options.optimizer.name,
            "data": options.data.text,
            "test_accuracy": final["accuracy"],
            "test_loss": final["loss"],
            "steps": {str(rank): clock for rank, clock in sorted(clocks.items())},
            "samples": samples,
            "seconds": round(seconds, 3),
            "samples_per_second": round(samples / seconds, 1),
            "staleness_histogram": {str(k): v for k, v in sorted(histogram.items())},
            "lost": sorted(r for r in self._losses if r >= options.servers),
            "resumed_from_version": starts,
            "metrics": evaluator.history,
            "model_path": str(path),
            "step_times_path": str(step_times),
        }
        summary_path = folder / "summary.json"
        with replacing(summary_path) as partial:
            partial.write_text(json.dumps(summary, indent=2))
        member.etcd.put(member.keys.mnist_summary, json.dumps(summary))
        return {
            "model_path": str(path),
            "summary_path": str(summary_path),
            "metrics": {"test_accuracy": final["accuracy"], "test_loss": final["loss"]},
        }

    def _write_step_times(self, member: Member, path: Path) -> Path:
        """Every trainer's step durations (pull to push acknowledged, this attempt) as a
        trace `coordinator simulate --delay trace:PATH` replays: worker,step,seconds."""
        lines = ["worker,step,seconds"]
        for kv in member.etcd.get_prefix(member.keys.mnist_step_times)[0]:
            trainer = rank_of(kv.key)
            seconds = json.loads(kv.value)
            if not (
                0 <= trainer < self.options.trainers
                and isinstance(seconds, list)
                and all(type(v) in (int, float) and 0 <= v < math.inf for v in seconds)
            ):
                raise ValueError(f"step times under {kv.key!r} are not a trainer's list")
            lines += [f"{trainer},{step},{value:.6f}" for step, value in
                      enumerate(seconds, start=1)]  # fmt: skip
        with replacing(path) as partial:
            partial.write_text("\n".join(lines) + "\n")
        return path

    def _samples(self, trainer: int, clock: int) -> int:
        """Samples a trainer has trained on after `clock` steps (the last batch of an epoch
        may be short)."""
        rows = self.options.shard_rows(trainer)
        per_epoch = steps_per_epoch(rows, self.options.batch_size)
        epochs, rest = divmod(clock, per_epoch)
        return epochs * rows + min(rest * self.options.batch_size, rows)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class Evaluator:
    """Server 0's view of the whole model: every `eval_seconds` it reads every server's
    share (its own from memory, the others' as a reader) and scores the test set."""

    def __init__(self, job: MnistJob, member: Member, server: ps.Server, began: float) -> None:
        options = job.options
        self.job, self.member, self.server, self.began = job, member, server, began
        self.model = MnistNet(options.data.rows, options.data.cols, CLASSES)
        # Its own share from memory; the other servers' through a reader.
        others = range(1, options.servers)
        self.reader = ps.reader(self.model, job._peers(member), timeout=member.timeout, only=others)
        self.flat = self.reader.flat
        self.links: ps.Trainer | None = self.reader if options.servers > 1 else None
        assert job.test is not None
        self.x, self.y = torch.from_numpy(job.test.x), torch.from_numpy(job.test.y)
        self.history: list[dict[str, float]] = []
        self.final: dict[str, float] = {}
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="mnist-eval")
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.job.options.eval_seconds):
                self._evaluate()
        except BaseException as exc:  # reported by stop()
            self._failure = exc

    def _evaluate(self) -> dict[str, float]:
        at = time.time()  # the accuracy is the weights' at this time, not when it is known
        share, version = self.server.snapshot()
        self.flat.params[self.flat.slices[0]].copy_(share)
        versions = [version]
        if self.links is not None:
            versions += self.links.pull()
        with torch.no_grad():
            logits = self.model(self.x)
            loss = functional.cross_entropy(logits, self.y).item()
            accuracy = (logits.argmax(1) == self.y).float().mean().item()
        samples = len(self.server.log) * self.job.options.batch_size  # about: last batches
        record = {
            "n": len(self.history),
            "t": round(at - self.began, 3),
            "version": sum(versions),
            "samples": samples,
            "accuracy": accuracy,
            "loss": loss,
        }
        self.history.append(record)
        self.member.etcd.put(self.member.keys.mnist_metrics(record["n"]), json.dumps(record))
        emit(Metrics(rank=0, **record))
        return record

    def stop(self) -> None:
        """The last evaluation, on the final weights; then stop reading the other servers."""
        self._stop.set()
        self._thread.join()
        if self._failure is not None:
            raise self._failure
        self.final = self._evaluate()
        if self.links is not None:
            self.links.close()

    def close(self) -> None:
        self._stop.set()
        if self.links is not None:
            self.links.abort()


def _rank(member: Member) -> int:
    if member.rank is None:
        raise RuntimeError("the member has not joined the job")
    return member.rank
