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

from coordinator.barriers.arguments import barrier_spec, on_loss_of
from coordinator.context import Context, NotInJob
from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.program_steps import check_ranks, check_stop
from tests.support.commands import GRACE, PROGRAMS, TTL, Run, command_worker, rank_results
from tests.support.processes import Proc, wait_all
from tests.support.service import ServiceProc, wait_state
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]
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
    assert wait_all(procs, timeout=60) == [0] * n, [proc.stderr[-5:] for proc in procs]
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


def counted(path: Path) -> int:
    """The count a program keeps rewriting in `path` (0 before it is there, or while the
    program is between truncating and writing it)."""
    try:
        return int(path.read_text() or 0)
    except FileNotFoundError:
        return 0


def by_rank(procs: list[Proc]) -> dict[int, Proc]:
    return {p.wait_event(lambda e: e.get("phase") == "connect", 60)["rank"]: p for p in procs}


def errors_after_kill(record: Path, victim: Proc, ranks: list[int]) -> dict[int, dict[str, Any]]:
    """Kill `victim` (SIGKILL: its lease ends within the TTL); the others' recorded errors."""
    killed = time.time()
    victim.kill()
    wait_until(lambda: all((record / f"error{r}.json").exists() for r in ranks), 30, "errors")
    errors = {r: json.loads((record / f"error{r}.json").read_text()) for r in ranks}
    for error in errors.values():
        assert error["at"] - killed <= TTL + 2.0, error
    return errors


def test_a_killed_peer_makes_wait_raise_member_lost_within_ttl(
    etcd_server: EmbeddedEtcd, etcd: Etcd, spawn: Callable[[list[str]], Proc], tmp_path: Path
) -> None:
    program = steps_program(tmp_path, method="ssp", staleness=1, num_steps=2000, step_seconds=0.02)
    members = by_rank(start_members(etcd_server, etcd, spawn, "lost", 3, program))
    clocks = [tmp_path / f"clock{r}" for r in range(3)]
    wait_until(lambda: all(counted(c) >= 2 for c in clocks), 30, "steps")
    errors = errors_after_kill(tmp_path, members[2], [0, 1])
    assert all(e["error"] == "MemberLost" and e["rank"] == 2 for e in errors.values()), errors
    for rank in (0, 1):
        assert members[rank].wait_exit(timeout=30) != 0


def test_with_on_loss_continue_the_others_carry_on_without_a_killed_peer(
    etcd_server: EmbeddedEtcd, etcd: Etcd, spawn: Callable[[list[str]], Proc], tmp_path: Path
) -> None:
    program = steps_program(
        tmp_path, method="bsp", on_loss="continue", num_steps=60, step_seconds=0.03
    )
    procs = start_members(etcd_server, etcd, spawn, "carry", 3, program, "on_loss=continue")
    members = by_rank(procs)
    clocks = [tmp_path / f"clock{r}" for r in range(3)]
    wait_until(lambda: all(counted(c) >= 2 for c in clocks), 30, "steps")
    members[2].kill()
    for rank in (0, 1):
        assert members[rank].wait_exit(timeout=60) == 0, members[rank].stderr[-5:]
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(result["rows"]) == 60 and result["lost"] == [2]


def test_a_named_barrier_holds_every_program_and_a_lost_peer_fails_it(
    etcd_server: EmbeddedEtcd, etcd: Etcd, spawn: Callable[[list[str]], Proc], tmp_path: Path
) -> None:
    program = [sys.executable, str(PROGRAMS / "ctx_barrier.py"), str(tmp_path)]
    members = by_rank(start_members(etcd_server, etcd, spawn, "named", 3, program))
    passed = [tmp_path / f"passed{r}" for r in range(3)]
    wait_until(lambda: all(p.exists() for p in passed), 30, "barrier one")
    # Ranks 0 and 1 wait at `two`, which rank 2 never reaches: they are held there.
    time.sleep(0.5)  # a window in which a broken barrier would let them through
    assert not any((tmp_path / f"error{r}.json").exists() for r in (0, 1))
    assert all(members[r].process.poll() is None for r in (0, 1))
    errors = errors_after_kill(tmp_path, members[2], [0, 1])
    assert all(e["error"] == "MemberLost" and e["rank"] == 2 for e in errors.values()), errors


def test_a_named_barrier_passes_when_all_arrive(
    etcd_server: EmbeddedEtcd, etcd: Etcd, spawn: Callable[[list[str]], Proc], tmp_path: Path
) -> None:
    program = [sys.executable, str(PROGRAMS / "ctx_barrier.py"), str(tmp_path), "end"]
    procs = start_members(etcd_server, etcd, spawn, "all", 2, program)
    for proc in procs:
        assert proc.wait_exit(timeout=60) == 0, proc.stderr[-5:]
    times = [float((tmp_path / f"passed{r}").read_text()) for r in range(2)]
    assert len(times) == 2


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"method": "xsp"}, "method"),
        ({"method": "ssp", "staleness": -1}, "staleness"),
        ({"method": "pbsp", "sample": 3}, "sample"),
        ({"method": "bsp", "on_loss": "maybe"}, "on_loss"),
        ({"method": "ssp"}, "staleness"),
    ],
)
def test_bad_step_arguments_are_named_before_any_etcd_write(
    kwargs: dict[str, Any], named: str
) -> None:
    args = {"staleness": 0, "sample": 0, "staleness_upper": 0, "on_loss": "fail", **kwargs}
    with pytest.raises(ValueError, match=named):
        on_loss_of(args.pop("on_loss"))
        barrier_spec(**args, stepping=3)
    with pytest.raises(ValueError, match="num_steps"):
        check_stop(-1, None, 0)


@pytest.mark.parametrize("ranks", [[0, 3], [0, True], [1, 2], ["0"]])
def test_stepping_ranks_must_be_ranks_of_the_job_including_ones_own(ranks: list[Any]) -> None:
    with pytest.raises(ValueError, match="ranks"):
        check_ranks(ranks, 0, 3)
    assert check_ranks(range(1, 3), 1, 3) == {1, 2}
    assert check_ranks(None, 2, 3) == {0, 1, 2}


def test_context_outside_a_job_says_how_to_run_the_program(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COORDINATOR_")}
    code = "import coordinator; coordinator.context()"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "NotInJob" in done.stderr and "coordinator run --workers N" in done.stderr
    with pytest.raises(NotInJob, match="COORDINATOR_LEASE"):
        Context({**env, "COORDINATOR_JOB": "x"})


def test_the_ssp_loop_example_trains_and_reports_its_loss(
    etcd_server: EmbeddedEtcd,
    etcd: Etcd,
    launch: Callable[..., Run],
) -> None:
    run = launch(
        ["run", "--workers", "3", "--etcd", etcd_server.endpoint, "--namespace", etcd.namespace,
         "--job", "ssp-loop", "--", "python", "examples/ssp_loop.py"]
    )  # fmt: skip
    assert run.wait(120) == 0, run.stderr[-10:]
    results = rank_results(run.stdout)
    assert sorted(results) == [0, 1, 2]
    assert all(r["loss"] < 0.5 for r in results.values()), results
    reports = [json.loads(line.split("] ", 1)[-1]) for line in run.stdout if '"report"' in line]
    assert reports and all("loss" in r["metrics"] for r in reports)
    assert len(reports) < 3 * 40  # coalesced: at most one line per 0.2 s, plus the last
    # The reports' bar: every rank's steps of its total, titled with the latest loss.
    bars = [line for line in run.stderr if line.startswith("steps") and "loss" in line]
    total = sum(r["total"] for r in {r["rank"]: r for r in reports}.values())
    assert bars and f"{total}/{total}" in bars[-1], bars


def test_reports_of_any_metric_name_make_the_learning_curve() -> None:
    from coordinator.events import Report
    from coordinator.service.series import collect

    events = [Report(rank=0, step=s, metrics={"perplexity": 10.0 / s}) for s in (1, 2)]
    series = collect([*events, Report(rank=1, step=1, metrics={"perplexity": 1.0})], {})
    assert [(p.x, p.metrics) for p in series.curve] == [
        (1, {"perplexity": 10.0}),
        (2, {"perplexity": 5.0}),
    ]


CHATTY = """
import json, time
import coordinator
ctx = coordinator.context()
step, end = 0, time.monotonic() + 2
while time.monotonic() < end:  # the reporter's timer goes off a few times meanwhile
    step += 1
    ctx.report(step=step, loss=1.0 / step)
    print(json.dumps({"line": step, "pad": "x" * 200}))
"""


def test_reports_never_land_inside_the_programs_own_lines(
    etcd_server: EmbeddedEtcd,
    etcd: Etcd,
    launch: Callable[..., Run],
) -> None:
    """The reporter's timer thread writes while the program prints: every line the
    program printed arrives whole, and the reports are still read as reports."""
    run = launch(
        ["run", "--workers", "1", "--etcd", etcd_server.endpoint, "--namespace", etcd.namespace,
         "--job", "chatty", "--", sys.executable, "-c", CHATTY]
    )  # fmt: skip
    assert run.wait(120) == 0, run.stderr[-10:]
    lines = [line.split("] ", 1)[-1] for line in run.stdout]
    printed = [json.loads(line)["line"] for line in lines if line.startswith('{"line"')]
    reports = [json.loads(line) for line in lines if line.startswith('{"event": "report"')]
    assert len(reports) > 3 and reports[-1]["step"] == len(printed)
    assert printed == list(range(1, len(printed) + 1))


REPORTER = """
import coordinator
ctx = coordinator.context()
for step in range(1, 6):
    ctx.report(step=step, total=5, loss=1.0 / step, accuracy=0.5 + step / 20, my_metric=step)
ctx.flush()
"""


def test_reports_reach_the_jobs_progress_and_series_through_the_service(
    serve: Callable[..., ServiceProc],
) -> None:
    """`ctx.report` from a command job's program, through a real `coordinator serve`: the
    last report is the job's progress, and rank 0's reports (any names) are its curve;
    `coordinator submit --wait` shows them on its bar."""
    service = serve()
    cli = [sys.executable, "-m", "coordinator", "submit", "--server", service.url,
           "--token", service.generated_token() or "", "--workers", "2", "--id", "reporter",
           "--wait", "--", sys.executable, "-c", REPORTER]  # fmt: skip
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5/5" in done.stderr and "loss 0.2 " in done.stderr, done.stderr
    record = wait_state(service, "reporter", {"SUCCEEDED", "FAILED"})
    assert record["state"] == "SUCCEEDED", record["conditions"]
    progress = record["progress"]
    assert (progress["step"], progress["total"]) == (5, 5), progress
    assert progress["metrics"] == {"loss": 0.2, "accuracy": 0.75, "my_metric": 5.0}, progress

    series = service.http.get("/v1/jobs/reporter/series").json()
    assert series["curve_x"] == "step"
    last = series["curve"][-1]
    assert last["x"] == 5 and last["metrics"] == progress["metrics"], series["curve"]
    assert [p["x"] for p in series["curve"]] == sorted(p["x"] for p in series["curve"])
    assert series["curve"][0]["x"] == 1  # the first report is printed at once


@pytest.mark.slow  # ~35 s: three XGBoost trainings, one killed mid-way
def test_a_killed_peer_ends_the_xgboost_collective_with_member_lost_within_ttl(
    etcd_server: EmbeddedEtcd, etcd: Etcd, spawn: Callable[[list[str]], Proc], tmp_path: Path
) -> None:
    """`with ctx.xgboost(): xgboost.train(...)` on 3 members; rank 2's member is killed
    mid-training. The collective ends on the others within TTL + grace, naming rank 2,
    by either path: XGBoost fails (its sockets to rank 2 closed) and the program raises
    `MemberLost` with XGBoost's message; or XGBoost waits on its tracker instead, and the
    members, told by etcd, stop their programs and fail with `MemberLost`."""
    program = [sys.executable, str(PROGRAMS / "ctx_xgboost.py"), str(tmp_path)]
    members = by_rank(start_members(etcd_server, etcd, spawn, "xgblost", 3, program))
    rounds = [tmp_path / f"round{r}" for r in range(3)]
    wait_until(lambda: all(counted(r) >= 3 for r in rounds), 60, "rounds")
    killed = time.monotonic()
    members[2].kill()
    for rank in (0, 1):
        failed = members[rank].wait_event(lambda e: e["event"] == "failed", 30)
        assert members[rank].wait_exit(timeout=30) != 0
        assert members[rank].exited_at - killed <= TTL + GRACE + 3.0, failed
        assert "rank 2" in failed["message"], failed
        error = tmp_path / f"error{rank}.json"
        if error.exists():  # the program saw XGBoost fail: its own error names the loss
            recorded = json.loads(error.read_text())
            assert recorded["error"] == "MemberLost" and recorded["rank"] == 2, recorded
            assert "XGBoost:" in recorded["message"], recorded
        else:
            assert failed["error"] == "MemberLost", failed
