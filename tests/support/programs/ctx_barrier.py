"""Named barriers from a program: all pass `one`; then all but the last rank wait at
`two` while the last sleeps (its member is killed by the test). Writes
`<record>/passed<r>` after `one`, and `<record>/error<r>.json` on an error."""

import json
import signal
import sys
import time
from pathlib import Path

import coordinator

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # record the error while the member stops us
record = Path(sys.argv[1])
ctx = coordinator.context()
ctx.barrier("one")
(record / f"passed{ctx.rank}").write_text(str(time.time()))
if sys.argv[2:] == ["end"]:
    sys.exit(0)
if ctx.rank == ctx.world_size - 1:
    time.sleep(600)
try:
    ctx.barrier("two", timeout=60)
except coordinator.RendezvousError as exc:
    error = {"error": type(exc).__name__, "rank": getattr(exc, "rank", None), "at": time.time()}
    (record / f"error{ctx.rank}.json").write_text(json.dumps(error))
    sys.exit(3)
