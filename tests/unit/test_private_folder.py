"""A member's private folder: 0700, named for its process, and swept once that process is gone."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from coordinator.jobs.private_folder import PREFIX, make_private_folder, sweep_private_folders


def a_dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_folder_is_private_and_named_for_its_process(tmp_path: Path) -> None:
    folder = make_private_folder("job-1", str(tmp_path))
    assert folder.parent == tmp_path
    assert folder.name.startswith(f"{PREFIX}{os.getpid()}-job-1-")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_only_folders_of_gone_processes_are_swept(tmp_path: Path) -> None:
    dead = tmp_path / f"{PREFIX}{a_dead_pid()}-job-abc"
    dead.mkdir()
    (dead / "roster.json").write_text("{}")
    alive = tmp_path / f"{PREFIX}{os.getpid()}-job-abc"
    alive.mkdir()
    a_file = tmp_path / f"{PREFIX}{a_dead_pid()}-not-a-folder"
    a_file.write_text("x")
    other = tmp_path / "coordinator-etcd-xyz"
    other.mkdir()

    assert sweep_private_folders(tmp_path) == [dead]
    assert not dead.exists()
    assert alive.exists() and a_file.exists() and other.exists()


def test_making_a_folder_sweeps_a_killed_members(tmp_path: Path) -> None:
    killed = tmp_path / f"{PREFIX}{a_dead_pid()}-job-z"
    killed.mkdir()
    make_private_folder("job-z", str(tmp_path))
    assert not killed.exists()
