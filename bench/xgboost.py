"""Distributed XGBoost (N members, one thread each) against single-node XGBoost
(N threads) on the same synthetic data, in one run.

Single node: this process generates the whole data set, builds one DMatrix
and trains with `nthread = N`. Distributed: N `coordinator worker --kind
xgboost` processes against an embedded etcd; each generates only its row
shard and trains with one thread, the tracker on rank 0. Both evaluate on the
same separate evaluation set, so model quality is compared too.

    python bench/xgboost.py                          # 1M x 28, 20 rounds, N = 2
    python bench/xgboost.py --rows 200000 --rounds 10

"Rendezvous" is the time members spent in the rendezvous phases and
barriers (leader election, address exchange, connect, training and cleanup
barriers), from their own phase timeline; its share is of the distributed
wall time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

# This file is named like the library: run as a script, its own folder comes first
# on sys.path and `import xgboost` would import itself. Put the repository there.
HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent), *(p for p in sys.path if Path(p or ".").resolve() != HERE)]

import typer  # noqa: E402
import xgboost  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from coordinator.datasets import load_all, parse_source  # noqa: E402
from coordinator.etcd.server import EmbeddedEtcd  # noqa: E402
from coordinator.launch import WorkerCommand  # noqa: E402

console = Console(width=150)
BOOSTER = {"objective": "binary:logistic", "eval_metric": "logloss", "max_depth": 6, "eta": 0.3}


def single_node(data: str, eval_data: str, rounds: int, threads: int) -> dict[str, float]:
    began = time.perf_counter()
    train, test = load_all(parse_source(data)), load_all(parse_source(eval_data))
    trained_from = time.perf_counter()  # as for the members: from building the DMatrix on
    dtrain = xgboost.DMatrix(train.X, label=train.y, nthread=threads)
    deval = xgboost.DMatrix(test.X, label=test.y, nthread=threads)
    log: dict[str, Any] = {}
    xgboost.train(
        {**BOOSTER, "tree_method": "hist", "nthread": threads},
        dtrain,
        num_boost_round=rounds,
        evals=[(deval, "eval")],
        evals_result=log,
        verbose_eval=False,
    )
    ended = time.perf_counter()
    return {
        "total": ended - began,
        "train": ended - trained_from,
        "logloss": log["eval"]["logloss"][-1],
        "rendezvous": 0.0,
    }


def distributed(data: str, eval_data: str, rounds: int, members: int) -> dict[str, float]:
    params = {**BOOSTER, "data": data, "eval_data": eval_data, "rounds": rounds, "nthread": 1}
    with EmbeddedEtcd() as server, tempfile.TemporaryDirectory() as artifacts:
        server.security.export()  # members and clients log in as root (auth is on)
        params["artifacts"] = artifacts
        args = WorkerCommand(
            job_id=f"bench-{uuid.uuid4().hex[:6]}", world_size=members, etcd=server.endpoint,
            kind="xgboost", params={name: str(value) for name, value in params.items()},
        ).process_argv()  # fmt: skip
        began = time.perf_counter()
        procs = [
            subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(members)
        ]
        outputs = [proc.communicate() for proc in procs]
        ended = time.perf_counter()
    done = []
    for proc, (out, err) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"a member exited {proc.returncode}: {err.strip()[-2000:]}")
        done.append(next(json.loads(line) for line in out.splitlines() if '"done"' in line))
    rendezvous = max(sum(r["passed"] - r["arrived"] for r in d["timeline"]) for d in done)
    result = next(d["result"] for d in done if d["rank"] == 0)
    return {
        "total": ended - began,
        "train": max(d["result"]["train_seconds"] for d in done),
        "logloss": result["metrics"]["eval-logloss"],
        "rendezvous": rendezvous,
    }


def main(
    rows: int = typer.Option(1_000_000, help="training rows"),
    features: int = typer.Option(28, help="features"),
    rounds: int = typer.Option(20, help="boosting rounds"),
    members: int = typer.Option(2, help="distributed members N (one thread each)"),
) -> None:
    data, eval_data = f"synthetic:{rows}x{features}:1", f"synthetic:{rows // 5}x{features}:2"
    console.print(f"data {data}, eval {eval_data}, {rounds} rounds, depth {BOOSTER['max_depth']}")
    base = single_node(data, eval_data, rounds, members)
    ours = distributed(data, eval_data, rounds, members)
    table = Table(title=f"distributed N = {members} x 1 thread vs single node x {members} threads")
    for column in ("run", "total s", "train s", "s/round", "rendezvous s", "eval logloss"):
        table.add_column(column, justify="right")
    for name, r in ((f"single node ({members} threads)", base), (f"distributed N={members}", ours)):
        table.add_row(
            name,
            f"{r['total']:.2f}",
            f"{r['train']:.2f}",
            f"{r['train'] / rounds:.3f}",
            f"{r['rendezvous']:.2f}",
            f"{r['logloss']:.5f}",
        )
    console.print(table)
    console.print(
        f"ratio distributed / single node: total {ours['total'] / base['total']:.2f}x, "
        f"training {ours['train'] / base['train']:.2f}x; rendezvous share of the "
        f"distributed total {ours['rendezvous'] / ours['total']:.1%}; "
        f"eval logloss difference {ours['logloss'] - base['logloss']:+.5f}"
    )


if __name__ == "__main__":
    typer.run(main)
