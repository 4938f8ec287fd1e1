"""Which pids limit a local member gets (`coordinator.launch.pids`): where the pids
controller is found from /proc's texts, and the choice between a cgroup, RLIMIT_NPROC
and a warning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.launch.pids import (
    SERVICE_LEAF,
    CgroupParent,
    InCgroup,
    MemberCgroups,
    ProcessLimit,
    Unbounded,
    choose,
    delegate_pids,
    find_parent,
    join_argv,
)

HYBRID_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
HYBRID_OWN = "8:pids:/\n4:memory:/process_api/03add\n0::/\n"
V2_MOUNTS = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V2_OWN = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/svc.service\n"
CONTAINER_MOUNTS = "700 690 0:36 /docker/abc /sys/fs/cgroup/pids ro - cgroup cgroup rw,pids\n"
CONTAINER_OWN = "8:pids:/docker/abc\n"


def test_v1_s_pids_hierarchy_comes_before_v2_and_is_our_own_cgroup_in_it() -> None:
    assert find_parent(HYBRID_MOUNTS, HYBRID_OWN) == [
        CgroupParent(Path("/sys/fs/cgroup/pids"), 1),
        CgroupParent(Path("/sys/fs/cgroup/unified"), 2),
    ]


def test_v2_alone_gives_our_own_cgroup_and_a_container_sees_its_own_as_the_root() -> None:
    own = "user.slice/user-1000.slice/user@1000.service/app.slice/svc.service"
    assert find_parent(V2_MOUNTS, V2_OWN) == [CgroupParent(Path("/sys/fs/cgroup") / own, 2)]
    assert find_parent(CONTAINER_MOUNTS, CONTAINER_OWN) == [
        CgroupParent(Path("/sys/fs/cgroup/pids"), 1)
    ]


def test_no_cgroup_mounted_gives_nothing() -> None:
    assert find_parent("22 1 0:21 / /proc rw - proc proc rw\n", "") == []


def test_a_cgroup_wins_then_rlimit_for_a_uid_of_its_own_then_a_warning() -> None:
    parent = CgroupParent(Path("/sys/fs/cgroup/pids"), 1)
    assert choose(parent, dedicated_uid=False, limit=64) == InCgroup(parent.path, 64, 1)
    assert choose(None, dedicated_uid=True, limit=64) == ProcessLimit(64)
    unbounded = choose(None, dedicated_uid=False, limit=64)
    assert isinstance(unbounded, Unbounded) and "RLIMIT_NPROC" in unbounded.why


def test_a_member_joins_its_cgroup_before_anything_of_its_own_runs(tmp_path: Path) -> None:
    """The prelude writes the process's own pid (kept through exec) to the group's
    cgroup.procs, then becomes argv; here a plain folder stands in for the cgroup."""
    group = tmp_path / "member"
    group.mkdir()
    code = "import os; print(os.getpid())"
    ran = subprocess.run(join_argv(group, [sys.executable, "-c", code]), capture_output=True)
    assert ran.returncode == 0, ran.stderr
    assert (group / "cgroup.procs").read_text().strip() == ran.stdout.decode().strip()


def test_a_member_that_cannot_join_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    argv = join_argv(tmp_path / "missing", ["/bin/touch", str(marker)])
    assert subprocess.run(argv, capture_output=True).returncode == 125
    assert not marker.exists()


def test_member_cgroup_names_are_one_path_part(tmp_path: Path) -> None:
    cgroups = MemberCgroups(InCgroup(tmp_path, 8), tmp_path / "logs")
    for bad in ("", ".", "..", "a/b"):
        with pytest.raises(ValueError, match="one path part"):
            cgroups.release(bad)


def v2_cgroup(folder: Path, procs: str, subtree: str = "") -> Path:
    """A plain folder standing in for a cgroup v2 folder that offers pids."""
    folder.mkdir()
    (folder / "cgroup.controllers").write_text("cpu memory pids\n")
    (folder / "cgroup.subtree_control").write_text(subtree)
    (folder / "cgroup.procs").write_text(procs)
    return folder


def test_v2_alone_in_our_cgroup_we_move_to_a_leaf_and_hand_pids_down(tmp_path: Path) -> None:
    own = v2_cgroup(tmp_path / "svc", "4242\n")
    assert delegate_pids(own, 4242)
    assert (own / SERVICE_LEAF / "cgroup.procs").read_text() == "4242"
    assert (own / "cgroup.subtree_control").read_text() == "+pids"


def test_v2_with_other_processes_in_our_cgroup_we_leave_it_be(tmp_path: Path) -> None:
    own = v2_cgroup(tmp_path / "shared", "4242\n977\n")
    assert not delegate_pids(own, 4242)
    assert not (own / SERVICE_LEAF).exists()
    assert (own / "cgroup.subtree_control").read_text() == ""


def test_v2_already_handing_pids_down_is_used_as_it_is(tmp_path: Path) -> None:
    own = v2_cgroup(tmp_path / "delegated", "4242\n977\n", subtree="cpu pids\n")
    assert delegate_pids(own, 4242)
    assert not (own / SERVICE_LEAF).exists()
