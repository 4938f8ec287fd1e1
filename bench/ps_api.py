"""The public parameter server (`coordinator.ps`) against torch DDP (gloo), same model and data.

    python bench/ps_api.py                      # builtin digits, batch 32, 3 epochs
    python bench/ps_api.py --repeats 3 --epochs 1

Both sides train `MnistNet` with 2 trainers, each on its half of the data, batch 32,
SGD 0.02 with momentum 0.9, one torch thread per process, every process separate:

- **DDP**: 2 ranks, gloo over loopback, all_reduce of the gradients each step.
- **PS, BSP-aggregate**: `ps` server processes (`ps.serve(..., aggregate=True)`,
  listening behind the handshake) and 2 trainer processes (`ps.trainer`, `step`):
  each step's gradients are averaged into one update, as DDP does.
- **PS, ASP**: the same without aggregation: each gradient is applied as it comes.

Samples per second = samples trained / (last trainer's end - first trainer's start),
after connecting (DDP: after `init_process_group` and a barrier). The runs alternate
(DDP, then each PS setting, DDP again, ...) and each PS figure is against the mean of
the DDP runs before and after it; the table gives the median ratio per setting.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import typer
from rich.console import Console
from rich.table import Table
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator import ps
from coordinator.datasets.mnist import load_train_shard, parse_mnist
from coordinator.etcd.server import free_port
from coordinator.jobs.mnist.batches import batch_rows, steps_per_epoch
from coordinator.ps.model import MnistNet

console = Console(width=120)
TRAINERS = 2
LR, MOMENTUM = 0.02, 0.9


def _model(data: str) -> MnistNet:
    source = parse_mnist(data)
    torch.manual_seed(0)
    return MnistNet(source.rows, source.cols)


def _steps(data: str, trainer: int, epochs: int, batch: int) -> tuple[torch.Tensor, Any, int]:
    shard = load_train_shard(parse_mnist(data), trainer, TRAINERS)
    x, y = torch.from_numpy(shard.x), torch.from_numpy(shard.y)
    return x, y, epochs * steps_per_epoch(len(y), batch)


def _ddp_rank(rank: int, port: int, data: str, epochs: int, batch: int, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TRAINERS)
    model = torch.nn.parallel.DistributedDataParallel(_model(data))
    optimiser = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y, steps = _steps(data, rank, epochs, batch)
    dist.barrier()
    began = time.time()
    for step in range(steps):
        rows = batch_rows(0, rank, len(y), batch, step)
        optimiser.zero_grad()
        functional.cross_entropy(model(x[rows]), y[rows]).backward()
        optimiser.step()
    out.put((began, time.time(), epochs * len(y)))
    dist.destroy_process_group()
    # gloo's threads race the interpreter's shutdown, as in the server below.
    out.close()
    out.join_thread()
    sys.stdout.flush()
    os._exit(0)


def _server(
    index: int, servers: int, aggregate: bool, data: str, secret: bytes, ready: Any
) -> None:
    torch.set_num_threads(1)
    ids = [ps.ServerAddress(i, "127.0.0.1", 0, f"bench/{i}") for i in range(servers)]
    peers = ps.Peers("bench", 0, ids, secret)
    server = ps.serve(
        _model(data),
        index=index,
        servers=servers,
        trainers=TRAINERS,
        peers=peers,
        optimizer=ps.optimizer("sgd", LR, momentum=MOMENTUM),
        aggregate=aggregate,
    )
    endpoint = server.listen("127.0.0.1", 0, peers)
    ready.put((index, endpoint.port))
    try:
        server.wait(timeout=1800)
    finally:
        server.close()
    # Leave without the interpreter's shutdown: a torch thread still running then aborts
    # the process ("terminate called without an active exception"; see examples/ddp_mnist.py).
    sys.stdout.flush()
    os._exit(0)


def _trainer(index: int, peers: ps.Peers, data: str, epochs: int, batch: int, out: Any) -> None:
    torch.set_num_threads(1)
    model = _model(data)
    x, y, steps = _steps(data, index, epochs, batch)
    with ps.trainer(model, peers, index=index, timeout=60) as client:
        began = time.time()
        client.pull()
        for step in range(steps):
            rows = batch_rows(0, index, len(y), batch, step)
            client.zero_grad()
            functional.cross_entropy(model(x[rows]), y[rows]).backward()
            # One round trip: the gradient out, the weights with it applied back. Neither
            # method pulls between its steps for anything but this: ASP takes what is
            # there, and BSP-aggregate's next weights are this step's averaged update.
            client.push(pull=True)
        ended = time.time()
    out.put((began, ended, epochs * len(y)))


def _rate(results: list[tuple[float, float, int]]) -> float:
    began = min(r[0] for r in results)
    ended = max(r[1] for r in results)
    return sum(r[2] for r in results) / (ended - began)


def _results(out: Any, processes: list[multiprocessing.process.BaseProcess]) -> list[Any]:
    """One result per process; a process that exits without one fails the run."""
    results: list[Any] = []
    while len(results) < len(processes):
        try:
            results.append(out.get(timeout=1.0))
        except queue.Empty:
            dead = [p.name for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} failed (see its traceback above)") from None
    return results


def _run(processes: list[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        process.start()


def _join(processes: list[multiprocessing.process.BaseProcess]) -> None:
    try:
        for process in processes:
            process.join(1800)
            if process.exitcode != 0:
                raise RuntimeError(f"{process.name} exited {process.exitcode}")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()


def ddp(context: Any, data: str, epochs: int, batch: int) -> float:
    out = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=_ddp_rank, args=(r, port, data, epochs, batch, out), name=f"ddp{r}")
        for r in range(TRAINERS)
    ]
    _run(ranks)
    results = _results(out, ranks)
    _join(ranks)
    return _rate(results)


def parameter_server(
    context: Any, data: str, epochs: int, batch: int, servers: int, aggregate: bool
) -> float:
    ready, out = context.Queue(), context.Queue()
    secret = os.urandom(32)  # the children get it as an argument, never in argv
    serving = [
        context.Process(
            target=_server, args=(i, servers, aggregate, data, secret, ready), name=f"ps{i}"
        )
        for i in range(servers)
    ]
    _run(serving)
    try:
        ports = dict(ready.get(timeout=120) for _ in serving)
        addresses = [
            ps.ServerAddress(i, "127.0.0.1", ports[i], f"bench/{i}") for i in range(servers)
        ]
        peers = ps.Peers("bench", 0, addresses, secret)
        trainers = [
            context.Process(
                target=_trainer, args=(t, peers, data, epochs, batch, out), name=f"trainer{t}"
            )
            for t in range(TRAINERS)
        ]
        _run(trainers)
        results = _results(out, trainers)
        _join(trainers)
    finally:
        _join(serving)
    return _rate(results)


def main(
    data: str = typer.Option("digits", help="digits (builtin) or a directory of IDX files"),
    epochs: int = typer.Option(3, help="epochs per run"),
    batch_size: int = typer.Option(32, help="samples per step (per trainer)"),
    repeats: int = typer.Option(2, help="rounds of (DDP, each PS setting)"),
) -> None:
    context = multiprocessing.get_context("spawn")
    settings = [(servers, aggregate) for servers in (1, 2) for aggregate in (True, False)]
    ddp_rates = [ddp(context, data, epochs, batch_size)]
    ps_rates: dict[tuple[int, bool], list[float]] = {s: [] for s in settings}
    ratios: dict[tuple[int, bool], list[float]] = {s: [] for s in settings}
    for _ in range(repeats):
        rates = {s: parameter_server(context, data, epochs, batch_size, *s) for s in settings}
        ddp_rates.append(ddp(context, data, epochs, batch_size))
        reference = statistics.mean(ddp_rates[-2:])
        for setting, rate in rates.items():
            ps_rates[setting].append(rate)
            ratios[setting].append(rate / reference)
    table = Table(title=f"public PS vs DDP (gloo): {data}, {epochs} epochs, batch {batch_size}, "
                        f"2 trainers, {repeats} alternated rounds")  # fmt: skip
    for column in ("run", "samples/s (median)", "x DDP (median)", "x DDP (each round)"):
        table.add_column(column, justify="right")
    table.add_row("DDP, 2 ranks, gloo", f"{statistics.median(ddp_rates):.0f}", "1.00", "")
    for (servers, aggregate), rates in ps_rates.items():
        name = f"PS ps={servers}, {'BSP-aggregate' if aggregate else 'ASP'}"
        each = ", ".join(f"{r:.2f}" for r in ratios[(servers, aggregate)])
        median = statistics.median(ratios[(servers, aggregate)])
        table.add_row(name, f"{statistics.median(rates):.0f}", f"{median:.2f}", each)
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
