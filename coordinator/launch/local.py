"""Starting a member as a local process: the one place its process is made.

`coordinator run`'s launcher (pipes it reads events and program output from) and
the service's and agents' local launcher (log files, pidfiles, restarts) both
start members here, so argv, environment and the process's session come from the
`WorkerCommand` the same way for every local member.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from coordinator.die_with_parent import die_with_parent as die_with_parent_argv
from coordinator.launch.command import WorkerCommand
from coordinator.launch.pids import join_argv


def start_process(
    command: WorkerCommand,
    *,
    stdout: IO[Any] | int,
    stderr: IO[Any] | int,
    text: bool = False,
    own_session: bool = False,
    die_with_parent: bool = False,
    cwd: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
    cgroup: Path | None = None,
) -> subprocess.Popen[Any]:
    """`coordinator worker` as `command` says, in this environment plus the command's
    variables (and `extra_env`, which wins). `own_session`: its own process group and no
    terminal signals (it outlives a Ctrl-C aimed at us); `die_with_parent`: killed when
    the thread that started it ends (`coordinator.die_with_parent`); `cgroup`: it runs
    in that cgroup from its start (`coordinator.launch.pids`)."""
    argv = command.process_argv()
    if die_with_parent:
        argv = die_with_parent_argv(argv)
    if cgroup is not None:
        argv = join_argv(cgroup, argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **command.env(), **(extra_env or {})}
    return subprocess.Popen(
        argv,
        stdout=stdout,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        text=text,
        start_new_session=own_session,
        env=env,
        cwd=cwd,
    )
