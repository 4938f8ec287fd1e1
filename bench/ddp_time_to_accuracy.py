"""Time to accuracy, live: the parameter server under ASP at its defaults against torch DDP,
with one trainer 3x slower.

    python bench/ddp_time_to_accuracy.py                 # 3 trainers, 3 rounds (~2 min)

Both sides train `MnistNet` on the builtin digits, P trainers each on its own shard, batch
32, SGD lr 0.02 momentum 0.9 with the mnist job's decay (0.7 per epoch), one torch thread
per process, every process separate; the last trainer sleeps twice its compute time after
every step (3x slower, as the `mnist` kind's straggler does):

- **DDP**: P ranks, gloo over loopback: every step waits for the straggler's gradient.
- **PS, ASP**: one server (`coordinator.ps.serve`, the default update rule `async`) and P
  trainers that push and pull as they go (`push(pull=True)`): nobody waits.

Trainer 0 (DDP: rank 0) keeps a copy of its weights, stamped with the wall time, every
`--every` steps; after the run each copy is scored on the 1,000 test images, and the
time to `--target` is the first copy at or above it, from the trainers' common start.
The runs alternate (DDP, PS, DDP, PS, ...); the ratio is DDP's time over the PS's.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import typer
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ps_api import _join, _results, _run

from coordinator import ps
from coordinator.datasets.mnist import load_test, load_train_shard, parse_mnist
from coordinator.etcd.server import free_port
from coordinator.jobs.mnist.batches import batch_rows, steps_per_epoch
from coordinator.ps.model import FlatModel, MnistNet

LR, MOMENTUM, DECAY = 0.02, 0.9, 0.7
SLOW = 2.0  # the straggler sleeps this times its compute time: 3x slower


def _model() -> MnistNet:
    torch.manual_seed(0)
    return MnistNet()


def _shard(trainer: int, trainers: int, epochs: int, batch: int) -> tuple[Any, Any, int, int]:
    shard = load_train_shard(parse_mnist("digits"), trainer, trainers)
    per_epoch = steps_per_epoch(len(shard.y), batch)
    return torch.from_numpy(shard.x), torch.from_numpy(shard.y), per_epoch, epochs * per_epoch


def _step(model: Any, x: Any, y: Any, rows: Any, slow: bool) -> None:
    began = time.perf_counter()
    functional.cross_entropy(model(x[rows]), y[rows]).backward()
    if slow:
        time.sleep(SLOW * (time.perf_counter() - began))


def _flat(model: torch.nn.Module) -> Any:
    """A numpy copy: a tensor on a queue travels as shared memory, which dies with the
    sender (the ranks leave with os._exit)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _ddp_rank(rank: int, trainers: int, port: int, epochs: int, batch: int, every: int,
              out: Any) -> None:  # fmt: skip
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=trainers)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y, per_epoch, steps = _shard(rank, trainers, epochs, batch)
    decay = torch.optim.lr_scheduler.StepLR(sgd, step_size=per_epoch, gamma=DECAY)
    snapshots = []
    dist.barrier()
    began = time.time()
    for step in range(steps):
        sgd.zero_grad()
        _step(model, x, y, batch_rows(0, rank, len(y), batch, step), rank == trainers - 1)
        sgd.step()
        decay.step()
        if rank == 0 and (step + 1) % every == 0:
            snapshots.append((time.time() - began, _flat(model.module)))
    out.put((rank, began, snapshots))
    dist.destroy_process_group()
    out.close()
    out.join_thread()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads race the interpreter's shutdown


def _server(trainers: int, secret: bytes, ready: Any) -> None:
    torch.set_num_threads(1)
    peers = ps.Peers("bench", 0, [ps.ServerAddress(0, "127.0.0.1", 0, "bench/0")], secret)
    per_epoch = sum(steps_per_epoch(len(load_train_shard(parse_mnist("digits"), t, trainers).y),
                                    32) for t in range(trainers))  # fmt: skip
    optimizer = ps.optimizer("sgd", LR, momentum=MOMENTUM, decay=DECAY, decay_every=per_epoch)
    server = ps.serve(_model(), index=0, servers=1, trainers=trainers, peers=peers,
                      optimizer=optimizer)  # fmt: skip
    endpoint = server.listen("127.0.0.1", 0, peers)
    ready.put(endpoint.port)
    try:
        server.wait(timeout=1800)
    finally:
        server.close()
    sys.stdout.flush()
    os._exit(0)


def _trainer(index: int, trainers: int, peers: ps.Peers, epochs: int, batch: int, every: int,
             out: Any) -> None:  # fmt: skip
    torch.set_num_threads(1)
    model = _model()
    x, y, _, steps = _shard(index, trainers, epochs, batch)
    snapshots = []
    with ps.trainer(model, peers, index=index, timeout=120) as client:
        began = time.time()
        client.pull()
        for step in range(steps):
            client.zero_grad()
            _step(model, x, y, batch_rows(0, index, len(y), batch, step), index == trainers - 1)
            client.push(pull=True)
            if index == 0 and (step + 1) % every == 0:
                snapshots.append((time.time() - began, _flat(model)))
    out.put((index, began, snapshots))


def _time_to(results: list[Any], target: float) -> float | None:
    """From the trainers' common start to trainer 0's first copy scoring `target`."""
    start = min(r[1] for r in results)
    zero = next(r for r in results if r[0] == 0)
    test = load_test(parse_mnist("digits"))
    x, y = torch.from_numpy(test.x), torch.from_numpy(test.y)
    flat = FlatModel.build(MnistNet(), 1)
    with torch.no_grad():
        for seconds, weights in zero[2]:
            flat.params.copy_(torch.from_numpy(weights))
            if (flat.model(x).argmax(1) == y).float().mean().item() >= target:
                return seconds + zero[1] - start
    return None


def ddp(context: Any, trainers: int, epochs: int, batch: int, every: int,
        target: float) -> float | None:  # fmt: skip
    out, port = context.Queue(), free_port()
    ranks = [context.Process(target=_ddp_rank, args=(r, trainers, port, epochs, batch, every, out))
             for r in range(trainers)]  # fmt: skip
    _run(ranks)
    results = _results(out, ranks)
    _join(ranks)
    return _time_to(results, target)


def parameter_server(context: Any, trainers: int, epochs: int, batch: int, every: int,
                     target: float) -> float | None:  # fmt: skip
    ready, out = context.Queue(), context.Queue()
    secret = os.urandom(32)
    serving = [context.Process(target=_server, args=(trainers, secret, ready), name="ps0")]
    _run(serving)
    try:
        port = ready.get(timeout=120)
        peers = ps.Peers("bench", 0, [ps.ServerAddress(0, "127.0.0.1", port, "bench/0")], secret)
        workers = [context.Process(target=_trainer, name=f"trainer{t}",
                                   args=(t, trainers, peers, epochs, batch, every, out))
                   for t in range(trainers)]  # fmt: skip
        _run(workers)
        results = _results(out, workers)
        _join(workers)
    finally:
        _join(serving)
    return _time_to(results, target)


def main(
    trainers: int = typer.Option(3, min=2),
    epochs: int = typer.Option(3, help="passes over each trainer's shard"),
    rounds: int = typer.Option(3, help="alternated (DDP, PS) pairs"),
    target: float = typer.Option(0.9),
    every: int = typer.Option(5, help="steps between trainer 0's copies"),
) -> None:
    context = multiprocessing.get_context("spawn")
    times: dict[str, list[float | None]] = {"ddp": [], "ps": []}
    for _ in range(rounds):
        times["ddp"].append(ddp(context, trainers, epochs, 32, every, target))
        times["ps"].append(parameter_server(context, trainers, epochs, 32, every, target))
        print(f"to {target:g}: DDP {times['ddp'][-1]} s, PS ASP {times['ps'][-1]} s", flush=True)
    pairs = [(d, p) for d, p in zip(times["ddp"], times["ps"], strict=True) if d and p]
    if not pairs:
        print("no round where both reached the target")
        return
    ratios = [d / p for d, p in pairs]
    print(f"{trainers} trainers, one 3x slower, {epochs} epochs, digits: DDP "
          f"{statistics.median(d for d, _ in pairs):.1f} s, PS ASP "
          f"{statistics.median(p for _, p in pairs):.1f} s to {target:g} (medians); "
          f"the PS is {statistics.median(ratios):.2f}x sooner (each round: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; reached: DDP "
          f"{sum(t is not None for t in times['ddp'])}/{rounds}, PS "
          f"{sum(t is not None for t in times['ps'])}/{rounds})")  # fmt: skip


if __name__ == "__main__":
    typer.run(main)
