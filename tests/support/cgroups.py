"""The members' pids cgroups a test's service or agent left (its members killed after it
stopped, so no launcher saw them end): removed, so no test leaves one on the host."""

from __future__ import annotations

from pathlib import Path

from coordinator.launch.pids import InCgroup, MemberCgroups, local_plan
from tests.support.wait import wait_until


def remove_member_cgroups(logs: Path) -> None:
    """Remove every member cgroup of the launcher whose logs are in `logs` (killing what
    is left in them), and its base."""
    plan = local_plan(limit=1)
    if not isinstance(plan, InCgroup):
        return
    cgroups = MemberCgroups(plan, logs)
    if not cgroups.base.exists():
        return
    for group in [g for g in cgroups.base.iterdir() if g.is_dir()]:
        wait_until(lambda: cgroups.release(group.name), 10, f"cgroup {group} to go")  # noqa: B023
