"""A program that notes the SIGTERM it gets, and leaves a grandchild that ignores SIGTERM
(only SIGKILL ends it), writing their pids to $PIDS_DIR."""

import os
import signal
import subprocess
import sys
import time

rank = os.environ["RANK"]
grandchild = subprocess.Popen(
    [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
    ]
)


def on_sigterm(signum, frame):
    with open(os.path.join(os.environ["PIDS_DIR"], f"sigterm{rank}"), "w") as handle:
        handle.write("got SIGTERM\n")
    sys.exit(143)


signal.signal(signal.SIGTERM, on_sigterm)
with open(os.path.join(os.environ["PIDS_DIR"], f"rank{rank}"), "w") as handle:
    handle.write(f"{os.getpid()} {grandchild.pid}\n")
print(f"rank {rank} ready", flush=True)
time.sleep(600)
