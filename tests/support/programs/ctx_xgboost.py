"""XGBoost through `ctx.xgboost()`, for long enough to lose a peer mid-training.

argv[1]: a folder. Writes `<record>/round<r>` (the last round done) after each round,
and `<record>/error<r>.json` naming the error, its rank and message, and when it came.
SIGTERM is ignored, so an error raised while its member stops it is still recorded
(the member's SIGKILL follows after its grace).
"""

import json
import signal
import sys
import time
from pathlib import Path

import numpy as np
import xgboost
from xgboost.callback import TrainingCallback

import coordinator

signal.signal(signal.SIGTERM, signal.SIG_IGN)
record = Path(sys.argv[1])
ctx = coordinator.context()


class Rounds(TrainingCallback):
    def after_iteration(self, model: object, epoch: int, evals_log: object) -> bool:
        (record / f"round{ctx.rank}").write_text(str(epoch + 1))
        time.sleep(0.02)
        return False


rng = np.random.default_rng(ctx.rank)
x = rng.normal(size=(500, 8))
y = (x[:, 0] + rng.normal(scale=0.5, size=500) > 0).astype(float)
try:
    with ctx.xgboost(timeout=60):
        xgboost.train(
            {"objective": "binary:logistic", "tree_method": "hist", "nthread": 1},
            xgboost.DMatrix(x, label=y),
            num_boost_round=5000,
            callbacks=[Rounds()],
        )
except (coordinator.RendezvousError, RuntimeError) as exc:
    error = {"error": type(exc).__name__, "rank": getattr(exc, "rank", None),
             "message": str(exc), "at": time.time()}  # fmt: skip
    (record / f"error{ctx.rank}.json").write_text(json.dumps(error))
    sys.exit(3)
