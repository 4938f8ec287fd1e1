"""XGBoost's collective, set up from the coordinator's environment alone.

    coordinator run --workers 3 -- python examples/xgboost_collective.py

Rank 0 runs XGBoost's tracker on MASTER_ADDR:MASTER_PORT (the port the leader
reserved for the program); every rank joins the collective there with its RANK as
task id, trains on its shard of the breast cancer data, and prints the model's
digest, which is the same on every rank.
"""

import hashlib
import json
import os

import xgboost
from sklearn.datasets import load_breast_cancer
from xgboost import collective
from xgboost.tracker import RabitTracker


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    tracker = None
    if rank == 0:
        tracker = RabitTracker(n_workers=world, host_ip=host, port=port, sortby="task")
        tracker.start()
    x, y = load_breast_cancer(return_X_y=True)
    x, y = x[rank::world], y[rank::world]
    args = {
        "dmlc_tracker_uri": host,
        "dmlc_tracker_port": port,
        "dmlc_task_id": f"{rank:06d}",
        "dmlc_retry": 10,  # the tracker on rank 0 may start a moment after the others
        "dmlc_timeout": 60,
    }
    with collective.CommunicatorContext(**args):
        assert collective.get_rank() == rank, (collective.get_rank(), rank)
        log: dict = {}
        booster = xgboost.train(
            {"objective": "binary:logistic", "tree_method": "hist", "max_depth": 3, "nthread": 1},
            xgboost.DMatrix(x, label=y),
            num_boost_round=5,
            evals=[(xgboost.DMatrix(x, label=y), "train")],
            evals_result=log,
            verbose_eval=False,
        )
        digest = hashlib.sha256(booster.save_raw("ubj")).hexdigest()
    if tracker is not None:
        tracker.wait_for(60)
        tracker.free()
    result = {"rank": rank, "model_sha256": digest, "logloss": log["train"]["logloss"][-1]}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
