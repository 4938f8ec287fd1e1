"""Parameter-server speed: the transport against a raw socket, training against one process.

    python bench/ps.py                          # both parts, builtin digits
    python bench/ps.py --data /usr/share/datasets/fashion-mnist --epochs 1

1. **Transport.** One pull + push of the whole model (`MnistNet`, 861 kB each way)
   through a real `ParameterServer` in another process, against the floor: the
   same bytes sent to that process over a loopback TCP socket and the same
   number of bytes sent back (no framing, no model, no optimizer). Both ends are
   separate processes, as in a job. Pull + push runs twice: over a connection
   that went through the member endpoint's handshake (as in a job), and over a
   plain one to the same server (the figure without it); the handshake is once
   per connection. A third time, after the handshake, as a trainer's loop does it
   with `push(pull=True)`: one PUSH_PULL request per step, the gradient in and the
   weights with it applied back (the fused row). The four alternate in blocks of
   20 round trips, and each figure is the median of the blocks' ratios: this
   machine's speed drifts between runs by 2x, within a block hardly. Then one
   handshake is timed (connect + both proofs) against a plain connect,
   `--handshakes` times each.
2. **Throughput.** The `mnist` job with 1 server + 2 trainers (real processes,
   embedded etcd) under ASP and under BSP, against one process training the same
   model on the same data, same batch size and epochs, with 2 threads, run
   before and after each job (the ratio is against their mean). Each
   figure is samples per second of training (the job's from its summary:
   samples over the time from the start barrier to the last trainer's end).
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.datasets.mnist import load_train_shard, parse_mnist
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.jobs.mnist.batches import batch_rows
from coordinator.launch import WorkerCommand
from coordinator.ps.client import ServerAddress, ServerLinks
from coordinator.ps.model import FlatModel, MnistNet, server_tensors
from coordinator.ps.optim import OptimizerSpec
from coordinator.ps.server import ParameterServer
from coordinator.rendezvous import handshake
from coordinator.rendezvous.endpoint import MemberEndpoint

console = Console(width=120)
JOB, MEMBER, ROUND = "bench", "server-0", 1


def _serve(ready: multiprocessing.Queue, stop: multiprocessing.Event, secret: bytes) -> None:  # type: ignore[type-arg]
    """The other process: a parameter server on a member endpoint (trainer 0, after the
    handshake) and on a plain listener (trainer 1, no handshake), and a raw echo."""
    torch.set_num_threads(1)
    server = ParameterServer(
        job_id=JOB,
        round_=ROUND,
        index=0,
        tensors=server_tensors(MnistNet(), 1, 0),
        trainers=2,
        optimizer=OptimizerSpec("sgd", 0.01, 0.9),
    )
    endpoint = MemberEndpoint(JOB, MEMBER, "127.0.0.1")
    endpoint.handler = server.handle
    endpoint.authorize(secret, ROUND)
    plain = socket.create_server(("127.0.0.1", 0), backlog=128)

    def accept_plain() -> None:
        while True:
            conn, _ = plain.accept()
            threading.Thread(target=server.handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_plain, daemon=True).start()
    raw = socket.create_server(("127.0.0.1", 0))
    ports = (endpoint.port, plain.getsockname()[1], raw.getsockname()[1])
    ready.put((*ports, server.size * 4))
    conn, _ = raw.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = bytearray(server.size * 4)
    view = memoryview(buffer)
    with conn:
        while True:  # receive the model's bytes, send as many back
            got = 0
            while got < len(buffer):
                n = conn.recv_into(view[got:])
                if n == 0:
                    stop.wait()
                    endpoint.close()
                    return
                got += n
            conn.sendall(view)


@dataclass(frozen=True)
class Transport:
    """Medians in seconds, and medians of the blocks' ratios."""

    size: int  # bytes each way
    raw: float
    plain: float  # pull + push on a connection without the handshake
    authenticated: float  # pull + push on a connection after the handshake
    floor_ratio: float  # raw / authenticated
    fused: float  # push and pull in one request (PUSH_PULL), after the handshake
    fused_ratio: float  # raw / fused
    auth_ratio: float  # authenticated / plain
    connect: float  # a plain TCP connect
    handshake: float  # a connect and the handshake both ways


def _round_trips(links: ServerLinks, count: int, step: int, fused: bool = False) -> list[float]:
    """Seconds of each pull + push; `fused`: each a push and pull in one request (a
    trainer's loop: the weights of step n + 1 come back with the gradient of step n)."""
    times = []
    if fused:
        links.pull()  # the first step's weights
    for clock in range(step + 1, step + count + 1):
        began = time.perf_counter()
        if fused:
            links.push_pull(clock)
        else:
            links.pull()
            links.push(clock)
        times.append(time.perf_counter() - began)
    return times


def transport(blocks: int, handshakes: int, per_block: int = 20) -> Transport:
    """Raw round trips of the model's bytes, and pull + push with and without the
    handshake, interleaved in blocks so all see the same machine; then connects."""
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    secret = handshake.new_secret()  # to the child through a pipe, never in argv
    process = context.Process(target=_serve, args=(ready, stop, secret))
    process.start()
    try:
        ps_port, plain_port, raw_port, size = ready.get(timeout=60)
        payload = memoryview(bytearray(size))
        raw = socket.create_connection(("127.0.0.1", raw_port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        flat = FlatModel.build(MnistNet(), 1)

        def links(port: int, trainer: int, secret: bytes | None) -> ServerLinks:
            address = ServerAddress(0, "127.0.0.1", port, MEMBER)
            return ServerLinks(
                flat, [address], job_id=JOB, round_=ROUND, trainer=trainer, timeout=10,
                secret=secret,
            )  # fmt: skip

        authenticated = links(ps_port, 0, secret)
        plain = links(plain_port, 1, None)
        times: dict[str, list[float]] = {"raw": [], "plain": [], "auth": [], "fused": []}
        floor_ratios: list[float] = []
        fused_ratios: list[float] = []
        auth_ratios: list[float] = []
        step = 0
        for _ in range(blocks):
            raw_block = []
            for _ in range(per_block):
                began = time.perf_counter()
                raw.sendall(payload)
                got = 0
                while got < size:
                    got += raw.recv_into(payload[got:])
                raw_block.append(time.perf_counter() - began)
            plain_block = _round_trips(plain, per_block, step)
            auth_block = _round_trips(authenticated, per_block, step)
            fused_block = _round_trips(authenticated, per_block, step + per_block, fused=True)
            step += 2 * per_block
            floor_ratios.append(statistics.median(raw_block) / statistics.median(auth_block))
            fused_ratios.append(statistics.median(raw_block) / statistics.median(fused_block))
            auth_ratios.append(statistics.median(auth_block) / statistics.median(plain_block))
            for name, block in (
                ("raw", raw_block), ("plain", plain_block), ("auth", auth_block),
                ("fused", fused_block),
            ):  # fmt: skip
                times[name] += block
        for link in (authenticated, plain):
            link.bye()
            link.close()
        raw.close()
        connect, shaken = _connects(ps_port, plain_port, secret, handshakes)
        return Transport(
            size=size,
            raw=statistics.median(times["raw"]),
            plain=statistics.median(times["plain"]),
            authenticated=statistics.median(times["auth"]),
            floor_ratio=statistics.median(floor_ratios),
            fused=statistics.median(times["fused"]),
            fused_ratio=statistics.median(fused_ratios),
            auth_ratio=statistics.median(auth_ratios),
            connect=connect,
            handshake=shaken,
        )
    finally:
        stop.set()
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


def _connects(ps_port: int, plain_port: int, secret: bytes, count: int) -> tuple[float, float]:
    """Median seconds of a plain connect, and of a connect with the handshake both ways
    (each closed at once; the server's side ends as a probe's does)."""
    key = handshake.key_for(secret, JOB, ROUND, MEMBER)
    plain, shaken = [], []
    for _ in range(count):
        began = time.perf_counter()
        with socket.create_connection(("127.0.0.1", plain_port), timeout=10):
            plain.append(time.perf_counter() - began)
        began = time.perf_counter()
        with socket.create_connection(("127.0.0.1", ps_port), timeout=10) as sock:
            handshake.offer(sock, key, 10)
            shaken.append(time.perf_counter() - began)
    return statistics.median(plain), statistics.median(shaken)


def one_process(data: str, epochs: int, batch_size: int, threads: int) -> float:
    """Samples per second of plain training in this process (the baseline)."""
    torch.set_num_threads(threads)
    shard = load_train_shard(parse_mnist(data), 0, 1)
    x, y = torch.from_numpy(shard.x), torch.from_numpy(shard.y)
    torch.manual_seed(0)
    model = MnistNet(shard.x.shape[2], shard.x.shape[3])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    rows = len(shard.y)
    steps = epochs * -(-rows // batch_size)
    began = time.perf_counter()
    for step in range(steps):
        batch = batch_rows(0, 0, rows, batch_size, step)
        optimizer.zero_grad()
        functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
    return epochs * rows / (time.perf_counter() - began)


def job(endpoint: str, data: str, epochs: int, batch_size: int, method: str) -> dict:
    """Run the mnist job (1 server, 2 trainers) as real processes; its summary."""
    job_id = f"bench-{method}-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as artifacts:
        params = {
            "data": data, "epochs": epochs, "batch_size": batch_size, "method": method,
            "eval_seconds": 3600, "checkpoint_every": 0, "artifacts": artifacts,
        }  # fmt: skip
        args = WorkerCommand(
            job_id=job_id, world_size=3, etcd=endpoint, kind="mnist",
            params={k: str(v) for k, v in params.items()},
        ).process_argv()  # fmt: skip
        processes = [
            subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for _ in range(3)
        ]
        try:
            for process in processes:
                _, err = process.communicate(timeout=1800)
                if process.returncode:
                    raise RuntimeError(f"a {method} member exited {process.returncode}: {err}")
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
        return json.loads((Path(artifacts) / job_id / "summary.json").read_text())


def main(
    data: str = typer.Option("digits", help="digits (builtin) or a directory of IDX files"),
    epochs: int = typer.Option(3, help="epochs of the throughput runs"),
    batch_size: int = typer.Option(32, help="samples per step (per trainer)"),
    blocks: int = typer.Option(20, help="blocks of 20 round trips each: raw, plain, ours"),
    handshakes: int = typer.Option(200, help="connections timed with and without handshake"),
    throughput: bool = typer.Option(True, help="also run the throughput part"),
) -> None:
    t = transport(blocks, handshakes)
    table = Table(
        title=f"transport: the model's {t.size / 1e3:.0f} kB each way, {blocks} x 20 interleaved"
    )
    for column in ("what", "median ms", "x floor speed", "time x no handshake"):
        table.add_column(column, justify="right")
    table.add_row("raw loopback round trip (floor)", f"{t.raw * 1e3:.3f}", "1.00", "")
    table.add_row("pull + push, no handshake", f"{t.plain * 1e3:.3f}", "", "1.00")
    table.add_row(
        "pull + push after the handshake (ours)",
        f"{t.authenticated * 1e3:.3f}",
        f"{t.floor_ratio:.2f}",
        f"{t.auth_ratio:.2f}",
    )
    table.add_row(
        "push + pull in one request (ours, fused)",
        f"{t.fused * 1e3:.3f}",
        f"{t.fused_ratio:.2f}",
        "",
    )
    table.add_row(f"plain TCP connect (x{handshakes})", f"{t.connect * 1e3:.3f}", "", "")
    table.add_row(
        f"connect + handshake both ways (x{handshakes})", f"{t.handshake * 1e3:.3f}", "", ""
    )
    console.print(table)
    if not throughput:
        return

    # Each job run sits between two baseline runs: its ratio is against their mean.
    baselines = [one_process(data, epochs, batch_size, threads=2)]
    table = Table(title=f"throughput: {data}, {epochs} epochs, batch {batch_size}")
    for column in ("run", "samples/s", "x one process (runs before and after)", "test accuracy"):
        table.add_column(column, justify="right")
    with EmbeddedEtcd() as server:
        server.security.export()  # members and clients log in as root (auth is on)
        for method in ("asp", "bsp"):
            summary = job(server.endpoint, data, epochs, batch_size, method)
            baselines.append(one_process(data, epochs, batch_size, threads=2))
            rate = summary["samples_per_second"]
            table.add_row(
                f"1 server + 2 trainers, {method}",
                f"{rate:.0f}",
                f"{rate / statistics.mean(baselines[-2:]):.2f}",
                f"{summary['test_accuracy']:.4f}",
            )
    rates = ", ".join(f"{rate:.0f}" for rate in baselines)
    table.add_row("one process, 2 threads", rates, "1.00", "")
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
