"""A user's own training loop paced by SSP(2): `coordinator run --workers 3 -- python
examples/ssp_loop.py`. Each rank fits a tiny linear model (numpy) on its own data shard;
rank 1 is a straggler (3x slower), and SSP lets the others run at most 2 steps ahead.
The loss reaches the job's progress and the dashboard through `ctx.report`."""

import json
import time

import numpy as np

import coordinator

ctx = coordinator.context()
rng = np.random.default_rng(ctx.rank)
true_w = np.arange(1.0, 6.0)
x = rng.normal(size=(256, 5))
y = x @ true_w + rng.normal(scale=0.1, size=256)
w = np.zeros(5)
delay = 0.03 if ctx.rank == 1 else 0.01
loss = float("nan")
for step in ctx.steps("ssp", staleness=2, num_steps=40):
    grad = 2 * x.T @ (x @ w - y) / len(y)
    w -= 0.05 * grad
    loss = float(np.mean((x @ w - y) ** 2))
    time.sleep(delay)  # the straggler's extra compute
    ctx.report(step=step + 1, total=40, loss=loss)
ctx.flush()
print(json.dumps({"rank": ctx.rank, "loss": loss}))
