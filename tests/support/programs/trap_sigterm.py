"""A program that notes the SIGTERM or SIGINT it gets, and leaves a grandchild that ignores
both (only SIGKILL ends it), writing their pids to $PIDS_DIR."""

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
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)",
    ]
)


def on_signal(signum, frame):
    with open(os.path.join(os.environ["PIDS_DIR"], f"signal{rank}"), "w") as handle:
        handle.write(f"got {signal.Signals(signum).name}\n")
    sys.exit(128 + signum)


signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
with open(os.path.join(os.environ["PIDS_DIR"], f"rank{rank}"), "w") as handle:
    handle.write(f"{os.getpid()} {grandchild.pid}\n")
print(f"rank {rank} ready", flush=True)
time.sleep(600)
