"""What rank 0 leaves of an `mnist` job once everyone is done: the trained model
(`model.pt`), the trainers' step times as a trace the simulator replays
(`step_times.csv`), and `summary.json` (also put in etcd)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from coordinator.files import replacing
from coordinator.jobs.mnist.evaluation import Evaluator
from coordinator.jobs.mnist.members import LostMembers
from coordinator.jobs.mnist.options import MnistOptions
from coordinator.keys import rank_of
from coordinator.ps import api as ps

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member


def write_results(
    member: Member,
    options: MnistOptions,
    server: ps.Server,
    evaluator: Evaluator,
    lost: LostMembers,
    began: float,
    ended: float,
) -> dict[str, object]:
    """Rank 0, after everyone is done: the model file and the summary."""
    folder = options.artifacts / member.job_id
    records = [json.loads(kv.value) for kv in member.etcd.get_prefix(member.keys.mnist_servers)[0]]
    histogram: dict[int, int] = {}
    clocks: dict[int, int] = {}
    for record in records:
        for staleness, count in record["staleness_histogram"].items():
            histogram[int(staleness)] = histogram.get(int(staleness), 0) + count
        for trainer, clock in record["clocks"].items():
            clocks[int(trainer) + options.servers] = clock
    starts = {r["server"]: r["resumed_from"] for r in records}
    step_times = _write_step_times(member, options, folder / "step_times.csv")
    samples = sum(
        options.samples(t, clock) - options.samples(t, server.core.start_clocks[t])
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
        "update_rule": options.rule.name,
        "data": options.data.text,
        "test_accuracy": final["accuracy"],
        "test_loss": final["loss"],
        "steps": {str(rank): clock for rank, clock in sorted(clocks.items())},
        "samples": samples,
        "seconds": round(seconds, 3),
        "samples_per_second": round(samples / seconds, 1),
        "staleness_histogram": {str(k): v for k, v in sorted(histogram.items())},
        "lost": sorted(r for r in lost.reasons if r >= options.servers),
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


def _write_step_times(member: Member, options: MnistOptions, path: Path) -> Path:
    """Every trainer's step durations (pull to push acknowledged, this attempt) as a
    trace `coordinator simulate --delay trace:PATH` replays: worker,step,seconds."""
    lines = ["worker,step,seconds"]
    for kv in member.etcd.get_prefix(member.keys.mnist_step_times)[0]:
        trainer = rank_of(kv.key)
        seconds = json.loads(kv.value)
        if not (
            0 <= trainer < options.trainers
            and isinstance(seconds, list)
            and all(type(v) in (int, float) and 0 <= v < math.inf for v in seconds)
        ):
            raise ValueError(f"step times under {kv.key!r} are not a trainer's list")
        lines += [f"{trainer},{step},{value:.6f}" for step, value in
                  enumerate(seconds, start=1)]  # fmt: skip
    with replacing(path) as partial:
        partial.write_text("\n".join(lines) + "\n")
    return path
