"""A model of your own on the parameter server: an MLP on the builtin digits, SSP, a straggler.

    coordinator run --workers 3 -- python examples/ps_custom.py --ps 1 --straggler 2

Ranks below `--ps` are servers (`coordinator.ps.serve`, listening on their member's
reserved port); the others are trainers (`coordinator.ps.trainer`): pull, a batch of
their shard, backward, push. Each connection proves the round's secret (read from
the job's roster in etcd with the member's own etcd user) before a PS frame travels.

Pacing: the trainers step under `coordinator.context().steps("ssp", staleness=s,
ranks=<the trainers>)`, the step barrier the built-in jobs and the simulator use, so a
trainer never starts step c + 1 before every other trainer completed c - s. A pull after
the barrier lets a trainer through holds every update it waited for.

Each trainer evaluates the final weights on the 1000 test digits and prints
`{"rank", "accuracy", ...}`; it reports its loss with `ctx.report`, which reaches the
job's progress, the CLI's bar and the dashboard. Servers checkpoint to
`<artifacts>/<job>/ps/`; a restarted attempt (`max_restarts`) or a rerun of the same
job id with `--resume` continues from there, each trainer from its clock there. Builtin digits (4000
training, 1000 test), 2 trainers, 3 epochs, batch 32, SGD 0.05 with momentum 0.9:
about 0.90 test accuracy (0.85 or more in the test).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch import nn
from torch.nn import functional

import coordinator
from coordinator import ps
from coordinator.datasets.mnist import load_test, load_train_shard, parse_mnist


def mlp(rows: int, cols: int) -> nn.Module:
    """The user's model: any nn.Module works, this one is small."""
    return nn.Sequential(nn.Flatten(), nn.Linear(rows * cols, 128), nn.ReLU(), nn.Linear(128, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ps", type=int, default=1, help="ranks below this serve")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    # 0.5, not 0.9: with stale gradients applied one by one, 0.9 at this lr is on the edge of
    # stability (the final accuracy then swings with the order gradients land in).
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--staleness", type=int, default=2, help="SSP's bound in steps")
    parser.add_argument("--straggler", type=int, default=None, help="this rank is slower")
    parser.add_argument("--factor", type=float, default=3.0, help="the straggler's slowdown")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    ctx = coordinator.context()
    found = ps.program_peers(args.ps)  # the servers' addresses and the round's secret
    trainers = found.world_size - args.ps
    data = parse_mnist("digits")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # the same initial weights on every server
    model = mlp(data.rows, data.cols)
    steps = [
        args.epochs * math.ceil(len(load_train_shard(data, t, trainers).y) / args.batch)
        for t in range(trainers)
    ]

    if found.rank < args.ps:
        server = ps.serve(
            model,
            index=found.rank,
            servers=args.ps,
            trainers=trainers,
            peers=found.peers,
            optimizer=ps.optimizer("sgd", args.lr, momentum=args.momentum),
            checkpoint_dir=found.checkpoint_dir,
            checkpoint_every=50,
            resume=args.resume or ctx.attempt > 1,
            max_updates=sum(steps),
        )
        server.listen(*found.bind, found.peers)
        try:
            server.wait(idle=120)
        finally:
            server.close()
        server.save_checkpoint()
        print(json.dumps({"rank": found.rank, "role": "server", "version": server.version,
                          "resumed_from": server.resumed_from,
                          "staleness": server.staleness_histogram()}), flush=True)  # fmt: skip
        return

    index = found.rank - args.ps
    shard = load_train_shard(data, index, trainers)
    x, y = torch.from_numpy(shard.x), torch.from_numpy(shard.y)
    per_epoch = math.ceil(len(y) / args.batch)
    with ps.trainer(model, found.peers, index=index, timeout=120) as client:
        pacing = ctx.steps("ssp", staleness=args.staleness, ranks=range(args.ps, found.world_size),
                           start=client.clock, last_step=steps[index])  # fmt: skip
        for clock in pacing:  # waits until SSP lets this trainer start step clock + 1
            client.pull()
            epoch, position = divmod(clock, per_epoch)
            # A fresh shuffle each epoch, a function of (seed, trainer, epoch): a resumed
            # trainer takes up the data order where its checkpoint left it.
            generator = torch.Generator().manual_seed((args.seed * 7919 + index) * 1009 + epoch)
            order = torch.randperm(len(y), generator=generator)
            rows = order[position * args.batch : (position + 1) * args.batch]
            began = time.perf_counter()
            client.zero_grad()
            loss = functional.cross_entropy(model(x[rows]), y[rows])
            loss.backward()
            if found.rank == args.straggler:
                time.sleep((time.perf_counter() - began) * (args.factor - 1))
            client.push()
            ctx.report(step=client.clock, total=steps[index], loss=loss.item())
        # The final weights: every trainer's every push applied (a fast trainer waits for
        # the straggler here), so each trainer evaluates the same model.
        client.pull_at_least([sum(steps)] * args.ps)
        staleness = client.staleness
    test = load_test(data)
    with torch.no_grad():
        predicted = model(torch.from_numpy(test.x)).argmax(1)
    accuracy = (predicted == torch.from_numpy(test.y)).float().mean().item()
    print(json.dumps({"rank": found.rank, "role": "trainer", "steps": steps[index],
                      "accuracy": accuracy, "staleness": staleness}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
