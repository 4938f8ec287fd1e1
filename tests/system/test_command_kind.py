"""The `command` kind: a user's program as each member, with real etcd, processes and torch.

The DDP example trains as under torchrun (same losses); a killed peer stops the
others' programs, blocked in an all_reduce, within TTL + 2 s + grace, leaving no
process and no rendezvous key; a failing program names its rank and exit code;
bad programs fail every member before it joins; SIGTERM and SIGINT reach the program.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd, free_port
from coordinator.jobs.environment import (
    describe_status,
    local_ranks,
    program_environment,
    roster_document,
)
from coordinator.rendezvous.roster import MemberAddress, Roster
from tests.support.commands import GRACE, PROGRAMS, ROOT, TTL, Run, command_worker, rank_results
from tests.support.processes import Proc, gone
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd


def tree(pid: int) -> list[int]:
    """`pid` and every descendant (programs under their reapers, their children)."""
    process = psutil.Process(pid)
    return [pid, *(child.pid for child in process.children(recursive=True))]


def rendezvous_keys(etcd: Etcd, job: str) -> list[Any]:
    return etcd.get_prefix(etcd.key("jobs", job, "rendezvous") + "/")[0]


# -- the contract, without processes ------------------------------------------


def roster_of(hostnames: list[str]) -> Roster:
    members = [
        MemberAddress(rank=r, member_id=f"m{r}", host=f"10.0.0.{r}", port=9000 + r, hostname=h)
        for r, h in enumerate(hostnames)
    ]
    return Roster(job_id="j", round=5, world_size=len(members), members=members, secret="ab" * 32)


def test_local_ranks_count_the_members_on_the_same_host_in_rank_order() -> None:
    roster = roster_of(["a", "b", "a", "b", "a"])
    assert [local_ranks(roster, r) for r in range(5)] == [(0, 3), (0, 2), (1, 3), (1, 2), (2, 3)]


def test_the_environment_and_roster_file_follow_the_contract_without_the_secret() -> None:
    roster = roster_of(["a", "a"])
    ports = {0: 29500, 1: 29501}
    base = {"RANK": "9", "PATH": "/bin", "COORDINATOR_ETCD_USER": "job-j", "KEEP": "1"}
    env = program_environment(
        base,
        roster=roster,
        rank=1,
        ports=ports,
        roster_file=Path("/r.json"),
        artifacts=Path("/art/j"),
        etcd_endpoints="127.0.0.1:2379",
        namespace="/ns",
    )
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.0", "29500")
    assert env["COORDINATOR_ROSTER"] == "/r.json" and env["COORDINATOR_ARTIFACTS"] == "/art/j"
    assert "COORDINATOR_ETCD_USER" not in env and env["KEEP"] == "1"  # (the proxy holds it)
    document = roster_document(roster, ports)
    assert [m["reserved_ports"] for m in document["members"]] == [[29500], [29501]]
    assert "ab" * 32 not in json.dumps(document) + json.dumps(env)


def test_a_status_is_named_by_its_exit_code_or_signal() -> None:
    assert describe_status(7) == "exited with code 7"
    assert describe_status(-9) == "was killed by SIGKILL"


# -- real members --------------------------------------------------------------


def torchrun(port: int, script: list[str], tmp: Path) -> list[subprocess.Popen[str]]:
    """Three torchrun agents, one node each, on loopback. Their node ranks are given
    (torchrun's static rendezvous): what is compared is training, and three c10d agents
    racing for one store on one host now and then never met within the test's minutes.
    Their TMPDIR is `tmp`: torchrun leaves a log folder there that it never removes."""
    args = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "3", "--nproc-per-node", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(port),
    ]  # fmt: skip
    return [
        subprocess.Popen(
            [*args, "--node-rank", str(node), *script],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env={**os.environ, "TMPDIR": str(tmp)},
        )
        for node in range(3)
    ]


def test_the_ddp_example_trains_as_under_torchrun(
    etcd_server: EmbeddedEtcd, etcd: Etcd, launch: Callable[..., Run], tmp_path: Path
) -> None:
    script = ["examples/ddp_mnist.py", "--steps", "3"]
    ours = launch(
        ["run", "--workers", "3", "--etcd", etcd_server.endpoint, "--namespace", etcd.namespace,
         "--job", "ddp", "--ttl", "5", "--", "python", *script]
    )  # fmt: skip
    ours_code = ours.wait(120)  # done before torchrun starts: no port both may take
    outputs: list[str] = []
    for _ in range(2):  # the reference itself fails now and then here: it gets a second go
        theirs = torchrun(free_port(), script, tmp_path)
        try:  # (it takes ~15 s; now and then its agents hang after training, past any limit)
            outputs = [p.communicate(timeout=60)[0] for p in theirs]
        except subprocess.TimeoutExpired:
            continue
        finally:
            for p in theirs:
                p.kill()
                p.wait()
        if [p.returncode for p in theirs] == [0, 0, 0]:
            break
    assert [p.returncode for p in theirs] == [0, 0, 0], outputs
    assert ours_code == 0, ours.stderr[-10:]
    results = rank_results(ours.stdout)
    expected = rank_results("\n".join(outputs).splitlines())
    assert sorted(results) == sorted(expected) == [0, 1, 2]
    for rank, result in results.items():
        assert result["ok"] and result["all_reduce"] == 6.0  # 1 + 2 + 3
        assert result["losses"] == pytest.approx(expected[rank]["losses"], rel=1e-6)
        assert len(result["losses"]) == 3
    assert "all 3 workers passed every phase and cleaned up" in "\n".join(ours.stderr)
    assert rendezvous_keys(etcd, "ddp") == []


def test_the_roster_example_shows_every_member_to_every_member(
    etcd_server: EmbeddedEtcd, etcd: Etcd, launch: Callable[..., Run]
) -> None:
    run = launch(
        ["run", "--workers", "3", "--etcd", etcd_server.endpoint, "--namespace", etcd.namespace,
         "--job", "where", "--", "python", "examples/roster.py"]
    )  # fmt: skip
    assert run.wait(60) == 0, run.stderr[-10:]
    seen = [
        re.match(
            r"\[rank (\d)\] rank (\d) sees rank (\d) on \S+ at 127.0.0.1 "
            r"\(reserved ports \[(\d+)\]\)",
            line,
        )
        for line in run.stdout
    ]
    pairs = {(int(m[1]), int(m[2]), int(m[3])) for m in seen if m}
    assert pairs == {(r, r, other) for r in range(3) for other in range(3)}
    ports = {(int(m[3]), int(m[4])) for m in seen if m}
    assert len(ports) == 3 and len({port for _, port in ports}) == 3  # one port per rank, agreed
    masters = {line.split("master ")[1] for line in run.stdout if "master " in line}
    assert masters == {f"127.0.0.1:{dict(ports)[0]}"}


def test_the_xgboost_example_trains_one_model_through_the_collective(
    etcd_server: EmbeddedEtcd, etcd: Etcd, launch: Callable[..., Run]
) -> None:
    run = launch(
        ["run", "--workers", "2", "--etcd", etcd_server.endpoint, "--namespace", etcd.namespace,
         "--job", "xgbc", "--", "python", "examples/xgboost_collective.py"]
    )  # fmt: skip
    assert run.wait(90) == 0, run.stderr[-10:]
    results = rank_results(run.stdout)
    assert sorted(results) == [0, 1]
    assert len({r["model_sha256"] for r in results.values()}) == 1
    assert all(r["logloss"] < 0.3 for r in results.values())


def start_programs(
    etcd_server: EmbeddedEtcd,
    etcd: Etcd,
    spawn: Callable[[list[str]], Proc],
    folder: Path,
    job: str,
    n: int,
    script: str,
    ttl: int = TTL,
    env: dict[str, str] | None = None,
) -> tuple[list[Proc], list[int], list[int]]:
    """`n` members running `tests/support/programs/<script>`, each past connect with its program
    started (it writes `<folder>/rank<r>`): the members, their ranks, and every pid of
    their process trees. `env`: more variables for the programs."""
    given = {"PIDS_DIR": str(folder), **(env or {})}
    os.environ.update(given)  # the members pass them on to their programs
    try:
        program = [sys.executable, str(PROGRAMS / script)]
        args = command_worker(etcd_server, etcd, job, n, program, ttl=ttl)
        procs = [spawn(args) for _ in range(n)]
    finally:
        for name in given:
            del os.environ[name]
    ranks = [p.wait_event(lambda e: e.get("phase") == "connect", 60)["rank"] for p in procs]
    wait_until(lambda: all((folder / f"rank{r}").exists() for r in range(n)), 60, "programs")
    return procs, ranks, [pid for p in procs for pid in tree(p.process.pid)]


def test_a_killed_peer_stops_the_others_blocked_in_all_reduce(
    etcd_server: EmbeddedEtcd, etcd: Etcd, spawn: Callable[[list[str]], Proc], tmp_path: Path
) -> None:
    procs, ranks, pids = start_programs(
        etcd_server, etcd, spawn, tmp_path, "blocked", 3, "block_in_allreduce.py"
    )
    assert len(pids) == 3 * 4  # member, reaper, program, grandchild
    victim = procs[ranks.index(1)]
    victim.kill()
    killed_at = time.monotonic()
    for proc in procs:
        if proc is victim:
            continue
        assert proc.wait_exit(timeout=TTL + 2 + GRACE + 10) == 5, proc.stderr[-3:]
        assert proc.exited_at is not None and proc.exited_at - killed_at < TTL + 2 + GRACE
        failed = proc.wait_event(lambda e: e["event"] == "failed")
        assert failed["error"] == "MemberLost" and "member rank 1 " in failed["message"]
    wait_until(lambda: gone(pids), 10, "every process of every member to end")
    wait_until(lambda: rendezvous_keys(etcd, "blocked") == [], TTL + 5, "no rendezvous key")


def test_a_crashed_program_fails_every_member_at_once_naming_the_first_to_fail(
    etcd_server: EmbeddedEtcd, etcd: Etcd, spawn: Callable[[list[str]], Proc], tmp_path: Path
) -> None:
    """Rank 1's program exits 7 while the others wait for it in an all_reduce, which then
    fails there too. No member is lost, so nobody waits for a TTL (30 s here): every
    member fails within seconds, naming every program's failure, rank 1's exit 7 among
    them (which program ended first is a hint: torch's teardown can make rank 1's exit
    come after the others')."""
    ttl = 30
    procs, _, pids = start_programs(
        etcd_server, etcd, spawn, tmp_path, "crashed", 3, "block_in_allreduce.py", ttl=ttl,
        env={"CRASH_RANK_1": "1"},
    )  # fmt: skip
    began = time.monotonic()
    for proc in procs:
        assert proc.wait_exit(timeout=ttl) == 9, proc.stderr[-3:]
        failed = proc.wait_event(lambda e: e["event"] == "failed")
        assert failed["error"] == "ProgramFailed", failed
        message = failed["message"]
        assert message.count("exited with code") == 3, failed  # every program's failure
        first = message.startswith("rank 1: the program exited with code 7")
        assert first or "then rank 1's program exited with code 7" in message, failed
    assert time.monotonic() - began < ttl / 3  # far sooner than any lease could expire
    wait_until(lambda: gone(pids), 10, "every process of every member to end")
    wait_until(lambda: rendezvous_keys(etcd, "crashed") == [], 10, "no rendezvous key")


def test_a_program_exiting_7_on_rank_1_fails_the_run_naming_both(
    etcd_server: EmbeddedEtcd, etcd: Etcd, launch: Callable[..., Run]
) -> None:
    code = "import os, sys; sys.exit(7 if os.environ['RANK'] == '1' else 0)"
    run = launch(
        ["run", "--workers", "3", "--etcd", etcd_server.endpoint, "--namespace", etcd.namespace,
         "--job", "seven", "--ttl", str(TTL), "--", sys.executable, "-c", code]
    )  # fmt: skip
    assert run.wait(60) == 9  # ProgramFailed: the cause, not the others' MemberLost
    report = "\n".join(run.stderr)
    assert re.search(r"rank 1 exited 9:.*rank 1: the program exited with code 7", report)
    assert report.count("exited 5:") == 2  # the others lost rank 1
    assert rendezvous_keys(etcd, "seven") == []


@pytest.mark.parametrize(
    ("program", "cause"),
    [
        ([], "the program is empty"),
        (["no-such-program-4711"], "'no-such-program-4711' is not found"),
    ],
    ids=["empty", "missing"],
)
def test_a_bad_program_fails_every_member_before_it_joins(
    program: list[str],
    cause: str,
    etcd_server: EmbeddedEtcd,
    etcd: Etcd,
    spawn: Callable[[list[str]], Proc],
    launch: Callable[..., Run],
) -> None:
    procs = [spawn(command_worker(etcd_server, etcd, "bad", 3, program)) for _ in range(3)]
    for proc in procs:
        assert proc.wait_exit(timeout=30) == 2
        failed = proc.wait_event(lambda e: e["event"] == "failed")
        assert failed["phase"] == "init" and cause in failed["message"], failed
    assert etcd.get_prefix(etcd.namespace + "/")[0] == []
    run = launch(["run", "--workers", "2", "--etcd", etcd_server.endpoint, "--", *program])
    assert run.wait(30) == 2
    assert "\n".join(run.stderr).count(cause) >= 2


@pytest.mark.parametrize(
    ("signum", "error"),
    [(signal.SIGTERM, "Terminated"), (signal.SIGINT, "KeyboardInterrupt")],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signal_to_a_member_reaches_its_program_and_it_leaves_cleanly(
    signum: signal.Signals,
    error: str,
    etcd_server: EmbeddedEtcd,
    etcd: Etcd,
    spawn: Callable[[list[str]], Proc],
    tmp_path: Path,
) -> None:
    job = f"sig{signum.value}"
    procs, ranks, pids = start_programs(
        etcd_server, etcd, spawn, tmp_path, job, 2, "trap_sigterm.py"
    )
    target, other = procs[ranks.index(0)], procs[ranks.index(1)]
    target.process.send_signal(signum)
    signalled_at = time.monotonic()
    assert target.wait_exit(timeout=GRACE + 10) == 130
    # Its grandchild ignores the signal: the member waited the grace, then SIGKILLed the group.
    assert target.exited_at is not None and target.exited_at - signalled_at < GRACE + 3
    assert (tmp_path / "signal0").read_text() == f"got {signum.name}\n"
    failed = target.wait_event(lambda e: e["event"] == "failed")
    assert failed["error"] == error
    # The member left: the other saw it go at once (no lease to wait for), and stopped.
    assert other.wait_exit(timeout=GRACE + 10) == 5
    assert "member rank 0 " in other.wait_event(lambda e: e["event"] == "failed")["message"]
    wait_until(lambda: gone(pids), 10, "every process of both members to end")
    assert rendezvous_keys(etcd, job) == []


def test_a_program_after_dashes_means_kind_command_and_the_cause_sets_the_run_code() -> None:
    import typer

    from coordinator.cli.members import member_kind
    from coordinator.cli.run_display import run_exit_code

    assert member_kind(None, ["python", "x.py"], default=None) == "command"
    assert member_kind("command", [], default=None) == "command"
    assert member_kind("xgboost", None, default=None) == "xgboost"
    assert member_kind(None, None, default="noop") == "noop"
    for given, program in (("xgboost", ["python"]), (None, None)):
        with pytest.raises(typer.BadParameter):
            member_kind(given, program, default=None)
    assert run_exit_code([5, 9, 5]) == 9 and run_exit_code([5, 5]) == 5


def test_published_ports_are_checked_before_use() -> None:
    """The reserved ports come from keys any member of the job may write: a rank out of
    range or a value that is no port is refused, naming the key."""
    from coordinator.etcd.txn import KeyValue
    from coordinator.jobs.command import published_ports

    def kv(rank: str, port: str) -> KeyValue:
        return KeyValue(f"/ns/jobs/j/command/5/ports/{rank}", port.encode(), 1, 1, 0)

    assert published_ports([kv("000000", "4000"), kv("000001", "4001")], 2) == {0: 4000, 1: 4001}
    for bad in (kv("000002", "4000"), kv("000000", "70000"), kv("x", "1"), kv("000000", "-1")):
        with pytest.raises(RuntimeError, match="/ns/jobs/j/command/5/ports/"):
            published_ports([bad], 2)
