"""A program that blocks: every rank but 1 enters an all_reduce that rank 1 never joins.

With CRASH_RANK_1 set, rank 1 exits 7 instead (a bug of its own), and the others'
all_reduce fails with gloo's error: their programs fail because rank 1's did.

Each rank first starts a grandchild (a sleeping Python) and writes both pids to
$PIDS_DIR, so a test can check that nothing of the program outlives its member.
"""

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.path.join(os.environ["PIDS_DIR"], f"rank{rank}"), "w") as handle:
    handle.write(f"{os.getpid()} {grandchild.pid}\n")
print(f"rank {rank} entering all_reduce" if rank != 1 else "rank 1 idle", flush=True)
if rank == 1:
    if os.environ.get("CRASH_RANK_1"):
        sys.exit(7)
    time.sleep(600)
dist.all_reduce(torch.ones(1))
print("all_reduce returned", flush=True)
