"""XGBoost's collective from a program of your own, through `coordinator.context()`.

    coordinator run --workers 3 -- python examples/xgboost_collective.py

`ctx.xgboost()` runs XGBoost's tracker on rank 0 (on the port its member reserved,
MASTER_PORT) and joins every rank to the collective with its rank as task id. Each
rank trains on its shard of the breast cancer data and prints the model's digest,
which is the same on every rank. A lost peer ends the collective with `MemberLost`.
"""

import hashlib
import json

import xgboost
from sklearn.datasets import load_breast_cancer

import coordinator


def main() -> None:
    ctx = coordinator.context()
    x, y = load_breast_cancer(return_X_y=True)
    x, y = x[ctx.rank :: ctx.world_size], y[ctx.rank :: ctx.world_size]
    log: dict = {}
    with ctx.xgboost(timeout=60):
        booster = xgboost.train(
            {"objective": "binary:logistic", "tree_method": "hist", "max_depth": 3, "nthread": 1},
            xgboost.DMatrix(x, label=y),
            num_boost_round=5,
            evals=[(xgboost.DMatrix(x, label=y), "train")],
            evals_result=log,
            verbose_eval=False,
        )
    digest = hashlib.sha256(booster.save_raw("ubj")).hexdigest()
    ctx.report(step=5, total=5, logloss=log["train"]["logloss"][-1])
    result = {"rank": ctx.rank, "model_sha256": digest, "logloss": log["train"]["logloss"][-1]}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
