"""PyTorch DDP on the builtin MNIST digits, unchanged under torchrun or the coordinator.

    coordinator run --workers 3 -- python examples/ddp_mnist.py --steps 5
    torchrun --nnodes 3 --nproc-per-node 1 ... examples/ddp_mnist.py --steps 5

`init_process_group()` reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the
environment (env://), which both set. gloo on the CPU, NCCL when CUDA is present.
Each rank trains on its own shard of the 4000 training digits with the same seed;
it prints one line per step, then checks an all_reduce of a known tensor.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from coordinator.datasets.mnist import load_train_shard, parse_mnist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp = nn.parallel.DistributedDataParallel(model.to(device))
    optimiser = torch.optim.SGD(ddp.parameters(), lr=0.1)

    shard = load_train_shard(parse_mnist("digits"), rank, world)
    x, y = torch.from_numpy(shard.x).to(device), torch.from_numpy(shard.y).to(device)
    losses = []
    for step in range(args.steps):
        rows = torch.arange(step * args.batch, (step + 1) * args.batch) % len(y)
        optimiser.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x[rows]), y[rows])
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)

    total = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(total)
    expected = world * (world + 1) / 2
    ok = total.item() == expected
    print(json.dumps({"rank": rank, "losses": losses, "all_reduce": total.item(), "ok": ok}))
    dist.destroy_process_group()
    # Leave without the interpreter's shutdown: a gloo thread may still drop its last
    # finished work then, and on a busy host that aborts the process ("terminate called
    # without an active exception", torch's race, under torchrun too).
    sys.stdout.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
