"""The server's cost per update under each update rule, against `plain`.

What a live server does per one-by-one gradient of `MnistNet` (215k parameters, one
server): the rule's `prepare` and the optimizer's out-of-place SGD step into the server's
pool of published weights, and for `dc` also keeping the weights each trainer pulls
borrowed (no copy). Rounds alternate the rules so the machine's noise falls on all
alike; the ratio is each rule's median time over plain's.

    python bench/rule_cost.py                 # 4 trainers, 30 rounds of 200 updates
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.ps.model import MnistNet  # noqa: E402
from coordinator.ps.optim import FlatOptimizer, OptimizerSpec  # noqa: E402
from coordinator.ps.published import PublishedWeights  # noqa: E402
from coordinator.ps.rules import RULES, UpdateRule, Updates  # noqa: E402


def per_update(rule: str, size: int, trainers: int, updates: int) -> float:
    """Seconds per update: `updates` gradients from `trainers` trainers in turn."""
    torch.manual_seed(0)
    spec = OptimizerSpec("sgd", 0.02, 0.9)
    optimizer = FlatOptimizer(spec, size)
    rules = Updates(UpdateRule(rule), trainers=trainers, aggregate=False, momentum=0.9)
    weights = PublishedWeights(torch.randn(size))
    grads = [torch.randn(size) * 1e-3 for _ in range(trainers)]
    pulled: dict[int, torch.Tensor] = {}
    started = time.perf_counter()
    for k in range(updates):
        trainer = k % trainers
        if rules.keeps_pulled_weights:  # the server keeps the trainer's pull borrowed
            kept = pulled.get(trainer)
            pulled[trainer] = weights.borrow()
            if kept is not None:
                weights.give_back(kept)
        grad = grads[trainer]
        scale, momentum = rules.prepare(grad, trainers - 1, weights.current, pulled.get(trainer))
        updated = weights.writable()
        optimizer.step(weights.current, grad, updated, scale, momentum)
        weights.publish(updated)
    return (time.perf_counter() - started) / updates


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--updates", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the live server's members run
    size = sum(p.numel() for p in MnistNet().parameters())
    times: dict[str, list[float]] = {rule: [] for rule in RULES}
    for _ in range(args.rounds):
        for rule in RULES:
            times[rule].append(per_update(rule, size, args.trainers, args.updates))
    plain = statistics.median(times["plain"])
    print(f"MnistNet, {size} parameters, {args.trainers} trainers, median of {args.rounds} "
          f"rounds of {args.updates} updates")  # fmt: skip
    for rule in RULES:
        median = statistics.median(times[rule])
        print(f"{rule:10s} {median * 1e6:8.1f} us per update   {median / plain:5.2f}x plain")
    extra = args.trainers * size * 4
    print(f"dc keeps the weights each trainer pulled: up to {args.trainers} x "
          f"{size * 4 / 1e6:.2f} MB = {extra / 1e6:.2f} MB more")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
