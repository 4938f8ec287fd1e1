"""`coordinator.context()` in a real `command` job: real etcd, real members, real programs.

Step barriers paced from user code keep each method's bound (checked from the
clocks each program recorded, with a 3x straggler); a killed peer fails `wait`
with `MemberLost` within TTL + 2 s, or is carried on without; named barriers;
reports reach the service; bad arguments and a program outside a job get errors
naming the cause.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from coordinator.context import Context, NotInJob, check_steps, check_stop
from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from tests.conftest import Proc, wait_until
from tests.test_command_kind import PROGRAMS, TTL, command_worker

ROOT = Path(__file__).parent.parent
STRAGGLER_FACTOR = 3
pytestmark = pytest.mark.one_etcd


def start_members(
    etcd_server: EmbeddedEtcd,
    etcd: Etcd,
    spawn: Callable[[list[str]], Proc],
    job: str,
    n: int,
    program: list[str],
    *params: str,
) -> list[Proc]:
    args = command_worker(etcd_server, etcd, job, n, program, ttl=TTL)
    cut = args.index("--")
    args = [*args[:cut], *(x for p in params for x in ("--param", p)), *args[cut:]]
    return [spawn(args) for _ in range(n)]


def steps_program(record: Path, **steps: Any) -> list[str]:
    return [
        sys.executable,
        str(PROGRAMS / "ctx_steps.py"),
        json.dumps({"record": str(record), **steps}),
    ]


def results(record: Path, n: int) -> dict[int, dict[str, Any]]:
    return {r: json.loads((record / f"rank{r}.json").read_text()) for r in range(n)}


def clock_at(rows: list[list[Any]], t: float) -> int:
    """A program's completed clock at wall time `t`, counted generously: a step counts
    from just before its `done` published it (so the check errs towards passing)."""
    return sum(1 for row in rows if row[4] <= t)


METHODS = [
    ({"method": "bsp"}, 0),
    ({"method": "ssp", "staleness": 2}, 2),
    ({"method": "asp"}, None),
    ({"method": "pbsp", "sample": 1}, 0),
    ({"method": "pssp", "staleness": 2, "sample": 1}, 2),
    ({"method": "dssp", "staleness": 1, "staleness_upper": 3}, 3),
]


@pytest.mark.parametrize(("method", "bound"), METHODS, ids=[m["method"] for m, _ in METHODS])
def test_a_user_loop_keeps_the_methods_bound_with_a_straggler(
    method: dict[str, Any],
    bound: int | None,
    etcd_server: EmbeddedEtcd,
    etcd: Etcd,
    spawn: Callable[[list[str]], Proc],
    tmp_path: Path,
) -> None:
    n, steps, straggler = 3, 10, 2
    program = steps_program(
        tmp_path, **method, num_steps=steps, straggler=straggler, factor=STRAGGLER_FACTOR,
        step_seconds=0.03, seed=7,
    )  # fmt: skip
    procs = start_members(etcd_server, etcd, spawn, "paced", n, program)
    for proc in procs:
        assert proc.wait_exit(timeout=60) == 0, proc.stderr[-5:]
    got = results(tmp_path, n)
    sampled = method["method"].startswith("p")
    widest = 0
    for rank, result in got.items():
        assert [row[0] for row in result["rows"]] == list(range(steps))
        for clock, slowest, observed, passed, _ in result["rows"]:
            behind = [clock_at(got[p]["rows"], passed) for p in got if p != rank]
            widest = max(widest, clock - min(behind))
            if bound is None:
                assert observed == {} and slowest is None
                continue
            observed = {int(r): c for r, c in observed.items()}
            assert all(clock - c <= bound for c in observed.values()), (rank, clock, observed)
            assert slowest is None or clock - slowest <= bound, (rank, clock, slowest)
            # From the recorded clocks: the peers the method looks at were there in time.
            peers = observed if sampled else [r for r in got if r != rank]
            for peer in peers:
                there = clock_at(got[peer]["rows"], passed)
                assert there >= min(clock - bound, steps), (rank, clock, peer, there)
    fast = [r for r in got if r != straggler]
    if bound is None:  # ASP: the fast ones ran far ahead of the straggler
        assert max(got[r]["ended"] for r in fast) < got[straggler]["ended"] - 0.2
        assert widest >= 4
    elif not sampled:
        assert method.get("staleness", 0) <= widest <= bound  # reaching the bound, held to it
