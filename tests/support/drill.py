"""The kill drill's trials: SIGKILL one member of a live job at a random moment, and
check that what docs/rendezvous.md promises ("Failure semantics") still holds. The
suite's short drill (tests/system/test_kill_drill.py) and `python bench/drill.py` (100
trials, with a report) both run them.

Each trial starts N real `coordinator worker` processes (N = 3 or 4, each after a random
delay of up to a second) against a real etcd, with a 2 s lease TTL and a job that lasts
a little (noop with `seconds`, or steps under BSP or SSP). It aims at a stage in turn
(start-up, each rendezvous phase, the job) and SIGKILLs a random member a random moment
after that member reaches it. Aiming matters: a uniform moment would almost always land
in the job, and the phases, which last a tenth of a second each, would go untested.
What the victim had done when it died is read afterwards from its output and etcd.

What must hold, per trial (`Trial.problems` lists what did not):

- no hang: every member ends within its deadline;
- every exit code is a documented one (`coordinator.worker.EXIT_CODES`);
- a victim that held a rank: every member that held one too fails with `MemberLost` (5),
  naming the victim's rank, within TTL + 2 s of the kill. Exit 0 is right only when the
  victim had reached the last barrier (`cleaner`): the others may have passed it;
- a victim killed before it took a rank (during start-up): no replacement comes, so the
  others can never elect N ranks. They wait out the phase deadline (`--timeout`) and
  fail with `RendezvousTimeout` (6), or with `MemberLost` (5) repeating the timeout of
  the first to leave; none succeeds;
- a member that took no rank before the kill (it started late) joins a broken job: it
  fails with 5 or 6, by its own deadline;
- no rendezvous key of the job is left a TTL after the last member ended or died.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from coordinator.etcd.client import Etcd
from coordinator.launch import WorkerCommand
from coordinator.rendezvous.errors import MemberLost, RendezvousTimeout
from coordinator.worker import EXIT_CODES
from tests.support.processes import Proc

PHASES = ["leader_election", "ip_exchange", "connect", "training", "cleaner"]
#: Where a kill is aimed, in turn; "startup": before the victim can have taken a rank.
STAGES = ["startup", *PHASES]
#: The victim's stage as observed: "joining" = it had arrived but held no rank yet;
#: "ended" = it had exited before the kill came (the kill missed).
UNRANKED = {"startup", "joining"}
TICK = 0.01  # how often the driver looks at the members, etcd and the clock


@dataclass(frozen=True)
class DrillConfig:
    ttl: int = 2  # etcd's minimum: a lost member is noticed within TTL + 2 s
    timeout: float = 6.0  # each phase's deadline: what an unranked kill leaves the others to
    members: tuple[int, int] = (3, 4)  # N, drawn in this range
    max_start_delay: float = 1.0
    job_seconds: float = 2.0  # how long the job runs between `connect` and `training`
    grace: float = 10.0  # slack on top of every deadline before a member counts as hung

    @property
    def lost_within(self) -> float:
        return self.ttl + 2.0


class Worker(Proc):
    """A `coordinator worker` process (the tests' `Proc`: its JSON lines, stderr and exit
    time collected), and what the drill reads of it."""

    def __init__(self, index: int, args: list[str]) -> None:
        super().__init__(args, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.index = index

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def code(self) -> int | None:
        return self.process.returncode if self.exited_at is not None else None

    def passed(self) -> list[str]:
        """The phases it reported passing, in order."""
        return [e["phase"] for e in list(self.events) if e.get("event") == "phase"]

    def rank(self) -> int | None:
        return next((e["rank"] for e in list(self.events) if e.get("rank") is not None), None)

    def failed(self) -> dict[str, Any] | None:
        return next((e for e in list(self.events) if e.get("event") == "failed"), None)

    def describe(self) -> str:
        tail = " | ".join(self.stderr[-3:])
        return (
            f"member {self.index} (pid {self.pid}, rank {self.rank()}): exit {self.code}, "
            f"passed {self.passed() or 'nothing'}; stderr: {tail or '-'}"
        )


@dataclass
class Survivor:
    index: int
    ranked: bool  # held a rank before the kill
    code: int | None
    after_kill: float | None  # its exit, in seconds after the kill (negative: before)
    error: str | None
    message: str | None


@dataclass
class Trial:
    seed: int
    number: int
    members: int
    kind: str
    params: list[str]
    target: str  # the stage the kill was aimed at
    victim: int
    stage: str = "?"  # what the victim had done when it died (see UNRANKED)
    victim_rank: int | None = None
    killed_after: float | None = None  # seconds from the trial's start
    survivors: list[Survivor] = field(default_factory=list)
    keys_left: list[str] = field(default_factory=list)
    keys_gone_after: float | None = None  # seconds after the last member ended or died
    problems: list[str] = field(default_factory=list)
    duration: float = 0.0

    @property
    def ranked_kill(self) -> bool:
        return self.stage not in UNRANKED and self.stage != "ended"

    def summary(self) -> str:
        codes = ", ".join(
            f"{s.index}{'' if s.ranked else '*'}:{s.code}"
            + (f"@{s.after_kill:.2f}s" if s.after_kill is not None else "")
            for s in self.survivors
        )
        if self.stage == "ended":
            kill = f"the kill missed member {self.victim}: it had ended; members {codes}"
        else:
            kill = (
                f"killed member {self.victim} (rank {self.victim_rank}) in {self.stage}; "
                f"survivors {codes} (* = held no rank at the kill)"
            )
        return (
            f"seed {self.seed} trial {self.number}: N={self.members} {self.kind} "
            f"{' '.join(self.params)}; aimed at {self.target}, {kill}; "
            f"keys left {len(self.keys_left)}"
        )


def trial_rng(seed: int, number: int) -> random.Random:
    """One stream per trial, so any trial can be run again alone."""
    return random.Random(f"drill-{seed}-{number}")


def plan(seed: int, number: int, config: DrillConfig) -> dict[str, Any]:
    """What the trial does: N, the job, start delays, the victim and when it dies."""
    rng = trial_rng(seed, number)
    n = rng.randint(*config.members)
    if number % 2 == 0:
        kind, params = "noop", [f"seconds={config.job_seconds:g}"]
    else:
        method = rng.choice(["bsp", "ssp"])
        kind = "steps"
        params = [f"method={method}", "num_steps=20", "step_seconds=0.05"]
        params += ["staleness=2"] if method == "ssp" else []
    target = STAGES[(number + seed) % len(STAGES)]  # every stage within six trials
    span = {"startup": 0.5, "training": config.job_seconds}.get(target, 0.1)
    return {
        "n": n,
        "kind": kind,
        "params": params,
        "delays": [rng.uniform(0, config.max_start_delay) for _ in range(n)],
        "victim": rng.randrange(n),
        "target": target,
        "kill_delay": rng.uniform(0, span),
    }


def run_trial(
    endpoint: str, namespace: str, seed: int, number: int, config: DrillConfig | None = None
) -> Trial:
    """One trial against etcd at `endpoint`; every process it starts is gone when it returns."""
    config = config or DrillConfig()
    p = plan(seed, number, config)
    trial = Trial(seed, number, p["n"], p["kind"], p["params"], p["target"], p["victim"])
    job = f"drill-{seed}-{number}-{random.SystemRandom().randrange(1 << 32):08x}"
    args = WorkerCommand(
        job_id=job, world_size=p["n"], etcd=endpoint, namespace=namespace, ttl=config.ttl,
        timeout=config.timeout, kind=p["kind"],
        params=dict(param.split("=", 1) for param in p["params"]),
    ).process_argv()  # fmt: skip
    workers: list[Worker | None] = [None] * p["n"]
    began = time.monotonic()
    with Etcd(endpoint, namespace=namespace) as etcd:
        keys = etcd.key("jobs", job, "rendezvous") + "/"
        try:
            _drive(trial, p, args, workers, etcd, keys, began, config)
        finally:
            for worker in workers:
                if worker is not None:
                    worker.kill(wait=False)
            for worker in workers:
                if worker is not None:
                    worker.finish()
        if trial.killed_after is not None or trial.stage == "ended":
            _check_keys(trial, workers, etcd, keys, began, config)
    trial.duration = time.monotonic() - began
    return trial


def _drive(
    trial: Trial,
    p: dict[str, Any],
    args: list[str],
    workers: list[Worker | None],
    etcd: Etcd,
    keys: str,
    began: float,
    config: DrillConfig,
) -> None:
    """Start the members on schedule, kill the victim, then judge how the others end."""
    victim_index = p["victim"]
    trigger_at: float | None = None  # when the victim reached the aimed-at stage
    killed_at: float | None = None
    kill_wall = 0.0
    snapshot: dict[int, int] = {}  # pid -> rank held right after the kill
    arrived: set[int] = set()  # pids with an arrival key right after the kill
    # A member's deadline: its start, the job, one phase deadline, and the slack.
    budget = config.timeout + config.job_seconds + config.ttl + config.grace
    while True:
        now = time.monotonic()
        for i, delay in enumerate(p["delays"]):
            if workers[i] is None and now - began >= delay:
                workers[i] = Worker(i, args)
        victim = workers[victim_index]
        if victim is not None and killed_at is None and trial.stage != "ended":
            if victim.exited_at is not None:  # it finished (or failed) before its death came
                trial.stage = "ended"
            else:
                if trigger_at is None and _reached(victim, p["target"], etcd, keys):
                    trigger_at = now
                if trigger_at is not None and now >= trigger_at + p["kill_delay"]:
                    victim.kill(wait=False)
                    killed_at, kill_wall = time.monotonic(), time.time()
                    trial.killed_after = killed_at - began
                    snapshot, arrived = _holders(etcd, keys)  # before its lease can end
        started = [w for w in workers if w is not None]
        if len(started) == len(workers) and all(w.exited_at is not None for w in started):
            break
        hung = [w for w in started if w.exited_at is None and now > w.started_at + budget]
        if hung:
            for w in hung:
                trial.problems.append(f"hang: {w.describe()} still running after {budget:g}s")
            return
        time.sleep(TICK)
    for worker in workers:
        assert worker is not None
        worker.finish()
    if killed_at is None:
        _judge_missed(trial, workers)
    else:
        _judge(trial, workers, killed_at, kill_wall, snapshot, arrived, config)


def _reached(victim: Worker, target: str, etcd: Etcd, keys: str) -> bool:
    """Has the victim reached the stage the kill is aimed at?"""
    if target == "startup":
        return True
    if target == "leader_election":  # it holds a rank key: inside the election's wait
        return victim.pid in _holders(etcd, keys)[0]
    before = PHASES[PHASES.index(target) - 1]
    return before in victim.passed()


def _holders(etcd: Etcd, keys: str) -> tuple[dict[int, int], set[int]]:
    """pid -> rank of every rank key naming a pid, and the pids with an arrival key."""
    ranks: dict[int, int] = {}
    for kv in etcd.get_prefix(keys + "members/")[0]:
        pid = _pid(kv.value)
        if pid is not None:
            ranks[pid] = int(kv.key.rsplit("/", 1)[1])
    arrivals = {pid for kv in etcd.get_prefix(keys + "arrivals/")[0] if (pid := _pid(kv.value))}
    return ranks, arrivals


def _pid(value: bytes) -> int | None:
    try:
        info = json.loads(value)
    except ValueError:
        return None
    return info.get("pid") if isinstance(info, dict) else None


def _judge_missed(trial: Trial, workers: list[Worker | None]) -> None:
    """The victim ended before its kill: nobody died, so every member must have succeeded."""
    for w in workers:
        assert w is not None
        trial.survivors.append(
            Survivor(w.index, True, w.code, None, *_failure(w))  # type: ignore[arg-type]
        )
        if w.code != 0:
            trial.problems.append(f"no kill, yet {w.describe()}")


def _failure(worker: Worker) -> tuple[str | None, str | None]:
    failed = worker.failed()
    return (failed["error"], failed["message"]) if failed else (None, None)


def _judge(
    trial: Trial,
    workers: list[Worker | None],
    killed_at: float,
    kill_wall: float,
    snapshot: dict[int, int],
    arrived: set[int],
    config: DrillConfig,
) -> None:
    victim = workers[trial.victim]
    assert victim is not None
    passed = victim.passed()  # all of it: the victim is dead, its output read to the end
    if passed:
        trial.stage = PHASES[len(passed)] if len(passed) < len(PHASES) else "done"
    elif victim.pid in snapshot:
        trial.stage = "leader_election"
    else:
        trial.stage = "joining" if victim.pid in arrived else "startup"
    trial.victim_rank = victim.rank() if passed else snapshot.get(victim.pid)
    for w in workers:
        assert w is not None and w.exited_at is not None
        if w is victim:
            continue
        ranked = w.pid in snapshot or any(
            e.get("event") == "phase" and e["t"] <= kill_wall for e in w.events
        )
        error, message = _failure(w)
        survivor = Survivor(w.index, ranked, w.code, w.exited_at - killed_at, error, message)
        trial.survivors.append(survivor)
        _judge_survivor(trial, w, survivor, config)
    codes = [s.code for s in trial.survivors]
    if trial.stage in UNRANKED and codes and RendezvousTimeout.exit_code not in codes:
        # The first to leave can only have left at its deadline: it names the missing rank.
        trial.problems.append(f"unranked kill, yet nobody timed out: exit codes {codes}")


def _judge_survivor(trial: Trial, w: Worker, s: Survivor, config: DrillConfig) -> None:
    problems = trial.problems
    if s.code not in EXIT_CODES:
        problems.append(f"undocumented exit code: {w.describe()}")
        return
    if trial.stage == "done":  # it had passed every phase: a kill cannot hurt the others
        if s.code != 0:
            problems.append(f"the victim had finished, yet {w.describe()}")
        return
    if not trial.ranked_kill:
        # Nobody can take the victim's place: the election never completes.
        if s.code not in (MemberLost.exit_code, RendezvousTimeout.exit_code):
            problems.append(f"unranked kill: expected exit 5 or 6, {w.describe()}")
        return
    if not s.ranked:  # it joined after the kill, a job already broken
        if s.code not in (MemberLost.exit_code, RendezvousTimeout.exit_code):
            problems.append(f"late joiner: expected exit 5 or 6, {w.describe()}")
        return
    assert s.after_kill is not None
    if s.after_kill > config.lost_within:
        problems.append(
            f"slow: ended {s.after_kill:.2f}s after the kill (> TTL + 2 = "
            f"{config.lost_within:g}s): {w.describe()}"
        )
    allowed = {MemberLost.exit_code} | ({0} if trial.stage == "cleaner" else set())
    if s.code not in allowed:
        problems.append(f"ranked kill in {trial.stage}: expected {sorted(allowed)}, {w.describe()}")
    elif s.code == MemberLost.exit_code and f"rank {trial.victim_rank} " not in (s.message or ""):
        # The first loss it saw must be the victim's; MemberLost names it.
        problems.append(f"MemberLost does not name rank {trial.victim_rank}: {w.describe()}")


def _check_keys(
    trial: Trial,
    workers: list[Worker | None],
    etcd: Etcd,
    keys: str,
    began: float,
    config: DrillConfig,
) -> None:
    """No rendezvous key may outlive the last member's end (or the kill) by more than a TTL."""
    ends = [w.exited_at for w in workers if w is not None and w.exited_at is not None]
    last = max(ends, default=time.monotonic())
    deadline = last + config.ttl + 1.0  # etcd expires leases in rounds of up to 0.5 s
    while True:
        left = [kv.key for kv in etcd.get_prefix(keys, keys_only=True)[0]]
        now = time.monotonic()
        if not left:
            trial.keys_gone_after = max(0.0, now - last)
            return
        if now > deadline:
            trial.keys_left = left
            trial.problems.append(
                f"{len(left)} rendezvous keys left {now - last:.2f}s after the last member "
                f"ended: {left}"
            )
            return
        time.sleep(TICK)


# -- the report ----------------------------------------------------------------------------


def _quantiles(values: list[float]) -> list[str]:
    if not values:
        return ["-"] * 5
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return [f"{v:.2f}" for v in (ordered[0], statistics.median(ordered), p95, ordered[-1])] + [
        str(len(values))
    ]


def report(trials: list[Trial], config: DrillConfig) -> list[Table]:
    """The distributions: outcomes, exit codes, time to fail by phase, keys left."""
    tables = []
    stages = ["startup", "joining", *PHASES, "done", "ended"]

    outcome = Table(title=f"{len(trials)} trials: where the victim died")
    for name in ["victim's stage", "trials", "ranked victim", "with problems"]:
        outcome.add_column(name, justify="left" if name == "victim's stage" else "right")
    by_stage: dict[str, list[Trial]] = defaultdict(list)
    for t in trials:
        by_stage[t.stage].append(t)
    for stage in stages:
        if by_stage.get(stage):
            ts = by_stage[stage]
            outcome.add_row(
                stage, str(len(ts)), str(sum(t.ranked_kill for t in ts)),
                str(sum(bool(t.problems) for t in ts)),
            )  # fmt: skip
    tables.append(outcome)

    codes = Table(title="exit codes of the other members")
    for name in ["code", "meaning", "ranked victim", "joined late", "unranked victim", "no kill"]:
        codes.add_column(name, justify="left" if name == "meaning" else "right")
    counts: dict[str, Counter[int | None]] = defaultdict(Counter)
    for t in trials:
        for s in t.survivors:
            if t.stage == "ended":
                case = "no kill"
            elif not t.ranked_kill:
                case = "unranked victim"
            else:
                case = "ranked victim" if s.ranked else "joined late"
            counts[case][s.code] += 1
    cases = ["ranked victim", "joined late", "unranked victim", "no kill"]
    for code in sorted({c for counter in counts.values() for c in counter}, key=lambda c: c or 0):
        meaning = EXIT_CODES.get(code, "[red]undocumented[/red]") if code is not None else "hung"
        codes.add_row(str(code), meaning, *(str(counts[case][code] or "") for case in cases))
    tables.append(codes)

    times = Table(
        title=f"time from the kill to each ranked member's exit (s), by the victim's stage; "
        f"bound TTL + 2 = {config.lost_within:g} s"
    )
    for name in ["victim's stage", "min", "p50", "p95", "max", "members", "over the bound"]:
        times.add_column(name, justify="left" if name == "victim's stage" else "right")
    for stage in PHASES:
        values = [
            s.after_kill
            for t in by_stage.get(stage, [])
            for s in t.survivors
            if s.ranked and s.after_kill is not None
        ]
        if values:
            over = sum(v > config.lost_within for v in values)
            times.add_row(stage, *_quantiles(values), str(over))
    unranked = [
        s.after_kill
        for t in trials
        if t.stage in UNRANKED
        for s in t.survivors
        if s.after_kill is not None
    ]
    if unranked:
        times.add_row(f"unranked (deadline {config.timeout:g} s)", *_quantiles(unranked), "-")
    tables.append(times)

    keys = Table(title="rendezvous keys a TTL after the last member ended or died")
    for name in ["trials", "with keys left", "keys left", "gone after (s): p50", "p95", "max"]:
        keys.add_column(name, justify="right")
    gone = [t.keys_gone_after for t in trials if t.keys_gone_after is not None]
    q = _quantiles(gone)
    keys.add_row(
        str(len(trials)), str(sum(bool(t.keys_left) for t in trials)),
        str(sum(len(t.keys_left) for t in trials)), q[1], q[2], q[3],
    )  # fmt: skip
    tables.append(keys)
    return tables
