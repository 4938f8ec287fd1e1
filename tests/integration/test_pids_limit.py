"""Members' pids cgroups on this host's real cgroup hierarchy (`coordinator.launch.pids`):
a thread bomb inside one is stopped at its limit, a process it leaves behind is killed
when the cgroup is released, and nothing is left of the cgroup. Skipped where no pids
cgroup is ours to make (the launcher then logs a warning instead)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from coordinator.jobs.program import REAPER
from coordinator.jobs.run_as import NPROC_ENV
from coordinator.launch.pids import InCgroup, MemberCgroups, join_argv, local_plan
from tests.support.wait import wait_until

BOMB = """
import threading, time
started = 0
try:
    for _ in range(10_000):
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        started += 1
except RuntimeError:
    pass
print(started, flush=True)
"""


@pytest.fixture
def cgroups(tmp_path: Path) -> Iterator[MemberCgroups]:
    plan = local_plan(limit=40)
    if not isinstance(plan, InCgroup):
        pytest.skip(f"no pids cgroup is ours here: {plan}")
    made = MemberCgroups(plan, tmp_path)
    yield made
    if made.base.exists():  # also when the test failed: nothing of ours stays
        for group in made.base.iterdir():
            if group.is_dir():
                made.release(group.name)  # the last one takes the base with it
    assert not made.base.exists()


def test_a_thread_bomb_in_a_member_cgroup_stops_at_its_limit(cgroups: MemberCgroups) -> None:
    group = cgroups.create("bomb.attempt-1.0")
    assert (group / "pids.max").read_text().strip() == "40"
    ran = subprocess.run(
        join_argv(group, [sys.executable, "-c", BOMB]), capture_output=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    started = int(ran.stdout)
    assert 0 < started < 40  # the interpreter's own thread counts too
    assert int((group / "pids.events").read_text().split()[1]) >= 1  # refused forks
    assert cgroups.release("bomb.attempt-1.0")
    assert not group.exists()


def test_releasing_a_member_kills_what_it_left_and_removes_its_cgroup(
    cgroups: MemberCgroups,
) -> None:
    group = cgroups.create("left.attempt-1.0")
    # The member starts a process in a session of its own, then ends.
    code = (
        "import subprocess as s; print(s.Popen(['sleep', '300'], start_new_session=True, "
        "stdout=s.DEVNULL, stderr=s.DEVNULL).pid)"
    )
    ran = subprocess.run(join_argv(group, [sys.executable, "-c", code]), capture_output=True)
    left = psutil.Process(int(ran.stdout))
    assert left.is_running() and str(left.pid) in (group / "cgroup.procs").read_text()
    wait_until(lambda: cgroups.release("left.attempt-1.0"), 10, "the cgroup to be removed")
    assert not group.exists()
    wait_until(lambda: not left.is_running() or left.status() == psutil.STATUS_ZOMBIE, 10, "it")


def test_a_sweep_removes_ended_members_cgroups_and_keeps_live_ones(
    cgroups: MemberCgroups,
) -> None:
    ended = cgroups.create("gone.attempt-1.0")
    live = cgroups.create("live.attempt-1.0")
    sleeper = subprocess.Popen(join_argv(live, ["sleep", "300"]))
    try:
        wait_until(lambda: str(sleeper.pid) in (live / "cgroup.procs").read_text(), 10, "join")
        assert cgroups.sweep() == 1
        assert not ended.exists() and live.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    wait_until(lambda: cgroups.release("live.attempt-1.0"), 10, "the live one's removal")


def test_a_run_s_cgroups_go_with_it(cgroups: MemberCgroups) -> None:
    mine = [cgroups.create(f"job.x.attempt-1.{i}") for i in range(2)]
    other = cgroups.create("job.attempt-1.0")
    cgroups.release_run("job.x")
    assert not any(group.exists() for group in mine) and other.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a program as another uid needs root")
def test_a_program_under_a_uid_of_its_own_gets_the_uid_s_process_limit() -> None:
    """No cgroup needed: the reaper sets RLIMIT_NPROC as it drops to the job's uid (which
    runs nothing else), so a thread bomb stops at the limit there too."""
    python = shutil.which("python3", path="/usr/bin:/usr/local/bin") or sys.executable
    argv = [sys.executable, "-I", "-S", str(REAPER), str(os.getpid()), "61090", python, "-c", BOMB]
    ran = subprocess.run(
        argv, env={"PATH": "/usr/bin:/bin", NPROC_ENV: "20"}, capture_output=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    assert 0 < int(ran.stdout) < 20
