"""The xgboost job with real worker processes, a real etcd and real XGBoost training.

One model comes out, identical on every member, and as good as single-node
XGBoost on the same data; each member read only its shard (its recorded
pieces and digest are checked against the whole data set); a member killed
mid-training fails the others fast, naming it; bad input fails every member
before the rendezvous and leaves no keys.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xgboost

from coordinator.datasets import digest, load_all, parse_source
from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from tests.support.processes import Proc, worker_args

PARAMS = {"max_depth": 4, "eta": 0.3, "eval_metric": "logloss", "rounds": 8, "seed": 3}
#: Distributed hist merges the members' quantile sketches, so its split candidates
#: differ slightly from one machine's: the eval logloss may differ by this much.
TOLERANCE = 0.02


def job_args(
    etcd_server: EmbeddedEtcd, etcd: Etcd, world: int, params: dict[str, Any], **options: Any
) -> list[str]:
    args = worker_args(
        etcd_server.endpoint, etcd.namespace, "xgb", world, kind="xgboost", **options
    )
    for name, value in params.items():
        args += ["--param", f"{name}={value}"]
    return args


def run_job(spawn: Any, args: list[str], world: int) -> dict[int, dict[str, Any]]:
    procs = [spawn(args) for _ in range(world)]
    results = {}
    for proc in procs:
        assert proc.wait_exit(timeout=120) == 0, proc.stderr[-5:]
        done = proc.wait_event(lambda e: e["event"] == "done")
        results[done["rank"]] = done["result"]
    return results


def single_node(data: str, eval_data: str, params: dict[str, Any]) -> float:
    """The same training on one machine: the eval logloss after the last round."""
    train, test = load_all(parse_source(data)), load_all(parse_source(eval_data))
    booster_params = {k: v for k, v in params.items() if k != "rounds"}
    log: dict[str, Any] = {}
    xgboost.train(
        {**booster_params, "objective": "binary:logistic", "tree_method": "hist", "nthread": 1},
        xgboost.DMatrix(train.X, label=train.y),
        num_boost_round=params["rounds"],
        evals=[(xgboost.DMatrix(test.X, label=test.y), "eval")],
        evals_result=log,
        verbose_eval=False,
    )
    return log["eval"]["logloss"][-1]


def write_csv_files(folder: Path, rows: int, files: int) -> str:
    """The synthetic data as CSV files with a header (label first), to read back by glob."""
    whole = load_all(parse_source(f"synthetic:{rows}x6:5"))
    folder.mkdir()
    for index, part in enumerate(np.array_split(np.arange(rows), files)):
        table = np.column_stack([whole.y[part], whole.X[part]])
        header = "label," + ",".join(f"f{i}" for i in range(6))
        np.savetxt(folder / f"part-{index}.csv", table, delimiter=",", header=header, comments="")
    return str(folder / "part-*.csv")


@pytest.mark.parametrize("world", [2, 3])
def test_members_train_one_model_as_good_as_single_node_each_on_its_own_shard(
    world: int, etcd_server: EmbeddedEtcd, etcd: Etcd, spawn: Any, tmp_path: Path
) -> None:
    data = (
        "synthetic:3000x6:5" if world == 2 else write_csv_files(tmp_path / "train", 3000, 2)
    )  # 3 members over 2 files: shards by row ranges across both files
    eval_data = "synthetic:1000x6:9"
    artifacts = tmp_path / "artifacts"
    params = {**PARAMS, "data": data, "eval_data": eval_data, "artifacts": artifacts}
    results = run_job(spawn, job_args(etcd_server, etcd, world, params), world)

    # One model: identical on every member, saved once by rank 0.
    assert len({r["model_sha256"] for r in results.values()}) == 1
    model = Path(results[0]["model_path"])
    assert model == artifacts / "xgb" / "model.json" and model.exists()
    saved = xgboost.Booster(model_file=str(model))
    assert hashlib.sha256(saved.save_raw("ubj")).hexdigest() == results[0]["model_sha256"]
    assert {r["rounds"] for r in results.values()} == {PARAMS["rounds"]}

    # As good as single-node XGBoost on the same data with the same parameters.
    distributed = results[0]["metrics"]["eval-logloss"]
    assert abs(distributed - single_node(data, eval_data, PARAMS)) <= TOLERANCE

    # Each member read only its shard: disjoint pieces covering every row once, and
    # the digest of what it held equals the digest of exactly those rows.
    whole = load_all(parse_source(data))
    offsets = dict(zip(whole.files, np.cumsum([0, *whole_file_rows(whole)]), strict=False))
    covered: list[int] = []
    for rank in range(world):
        record = json.loads(
            etcd.get(etcd.key("jobs", "xgb", "xgboost", "shards", f"{rank:06d}")).value
        )  # type: ignore[union-attr]
        pieces = record["data"]["pieces"]
        rows = [offsets[name] + i for name, start, stop in pieces for i in range(start, stop)]
        assert record["data"]["rows"] == len(rows) == results[rank]["shards"]["data"]["rows"]
        assert record["data"]["digest"] == digest(whole.X[rows], whole.y[rows])
        covered += rows
    assert sorted(covered) == list(range(len(whole.y)))

    # Per-round metrics and a summary are kept in etcd under the job.
    metrics, _ = etcd.get_prefix(etcd.key("jobs", "xgb", "xgboost", "metrics") + "/")
    assert len(metrics) == PARAMS["rounds"]
    assert json.loads(metrics[-1].value)["eval-logloss"] == pytest.approx(distributed)
    summary = json.loads(etcd.get(etcd.key("jobs", "xgb", "xgboost", "summary")).value)  # type: ignore[union-attr]
    assert summary["model_sha256"] == results[0]["model_sha256"]


def whole_file_rows(shard: Any) -> list[int]:
    """Rows per file of a whole data set, from its pieces (one piece per file)."""
    return [piece.stop - piece.start for piece in shard.pieces]


def test_a_member_killed_mid_training_fails_the_others_fast_naming_it(
    etcd_server: EmbeddedEtcd, etcd: Etcd, spawn: Any, tmp_path: Path
) -> None:
    params = {
        "data": "synthetic:200000x10:1",
        "rounds": 400,
        "max_depth": 8,
        "artifacts": tmp_path,
        "collective_timeout": 10,
    }
    procs: list[Proc] = [spawn(job_args(etcd_server, etcd, 3, params, ttl=2)) for _ in range(3)]
    ranks = [p.wait_event(lambda e: e.get("phase") == "leader_election", 60)["rank"] for p in procs]
    victim = procs[ranks.index(1)]
    victim.wait_event(lambda e: e["event"] == "round" and e["round"] >= 2, 120)
    victim.kill()
    killed_at = time.monotonic()
    for proc in procs:
        if proc is victim:
            continue
        assert proc.wait_exit(timeout=60) == 5, proc.stderr[:2]  # MemberLost
        assert proc.exited_at is not None and proc.exited_at - killed_at < 2 + 2 + 10
        failed = proc.wait_event(lambda e: e["event"] == "failed")
        assert failed["error"] == "MemberLost" and "rank 1" in failed["message"]
    # The job's etcd state says whom the survivors lost.
    records, _ = etcd.get_prefix(etcd.key("jobs", "xgb", "failures") + "/")
    assert sorted(json.loads(kv.value)["lost_rank"] for kv in records) == [1, 1]


@pytest.mark.parametrize(
    ("params", "cause"),
    [
        ({"data": "/nonexistent/train-*.csv"}, "no file matches '/nonexistent/train-\\*.csv'"),
        ({"data": "synthetic:2x4"}, "rank 2 of 3 gets no rows"),
        ({"tree_method": "exact"}, "tree_method='exact' is not supported"),
        ({"device": "cuda"}, "device is not supported"),
        ({"max_depth": "-3"}, "XGBoost refuses the parameters"),
        ({"colour": "red"}, "unknown parameter\\(s\\) colour"),
    ],
    ids=["bad-path", "empty-shard", "exact", "device", "bad-value", "unknown"],
)
def test_bad_input_fails_every_member_before_the_rendezvous_leaving_no_keys(
    params: dict[str, str],
    cause: str,
    etcd_server: EmbeddedEtcd,
    etcd: Etcd,
    spawn: Any,
    tmp_path: Path,
) -> None:
    args = job_args(etcd_server, etcd, 3, {**params, "artifacts": tmp_path})
    procs = [spawn(args) for _ in range(3)]
    for proc in procs:
        assert proc.wait_exit(timeout=60) == 2
        failed = proc.wait_event(lambda e: e["event"] == "failed")
        assert failed["phase"] == "init"
        assert re.search(cause, failed["message"]), failed["message"]
    keys, _ = etcd.get_prefix(etcd.namespace + "/")
    assert keys == []
