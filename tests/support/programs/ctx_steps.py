"""A user loop paced by `coordinator.context().steps(...)`, recording what it saw.

argv[1]: JSON with the `steps` arguments, plus `record` (a folder), `straggler`
(a rank), `factor` and `step_seconds`. Writes `<record>/rank<r>.json`: per step
the clock, the passage's slowest and observed clocks, and wall times when the
wait returned and before `done` published; or `<record>/error<r>.json` naming the
error and when it came. SIGTERM is ignored, so an error raised while its member
stops it is still recorded (the member's SIGKILL follows after its grace). A program
still running after 45 s prints where its threads are (a test waits 60 s for them).
"""

import faulthandler
import json
import signal
import sys
import time
from pathlib import Path

import coordinator

signal.signal(signal.SIGTERM, signal.SIG_IGN)
faulthandler.dump_traceback_later(45, exit=False)
args = json.loads(sys.argv[1])
record = Path(args.pop("record"))
straggler = args.pop("straggler", None)
factor = args.pop("factor", 3)
step_seconds = args.pop("step_seconds", 0.02)
ctx = coordinator.context()
sleep = step_seconds * (factor if ctx.rank == straggler else 1)
steps = ctx.steps(**args)
rows = []
try:
    clock = 0
    while steps.target is None or clock < steps.target:
        passage = steps.wait(clock)
        passed = time.time()
        time.sleep(sleep)
        partial = record / f".clock{ctx.rank}"
        partial.write_text(str(clock))
        partial.replace(record / f"clock{ctx.rank}")  # the test never reads a half-written one
        rows.append([clock, passage.slowest, passage.observed, passed, time.time()])
        steps.done(clock + 1)
        clock += 1
except coordinator.RendezvousError as exc:
    error = {"error": type(exc).__name__, "rank": getattr(exc, "rank", None), "at": time.time()}
    (record / f"error{ctx.rank}.json").write_text(json.dumps(error))
    sys.exit(3)
result = {"rank": ctx.rank, "rows": rows, "lost": steps.lost, "ended": time.time()}
(record / f"rank{ctx.rank}.json").write_text(json.dumps(result))
