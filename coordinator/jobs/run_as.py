"""Programs under a uid of their own: one uid per job on each host, from a range the
operator gives (`serve --run-as-uids`, `agent --run-as-uids`).

A `command` program runs whatever its submitter wrote. Under the service's or the
agent's uid it could read their etcd passwords, its member's, and any other job's
files. Under a uid of its job's own it can read none of them: the member keeps its
credentials (0600, its own uid), and the job's artifacts folder is the job uid's alone.

The launcher picks the uid (the next of the range, in turn, that no other running job
on this host holds; members of one job share it) and passes it in the member's
environment. Taking them in turn keeps a finished job's artifacts, still its uid's, out
of a new job's reach until the whole range has gone round. The
member starts the program under it (`jobs/program.py`) and hands the program only what
it must reach: its roster file, its artifacts folder, its etcd socket.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

RUN_AS_ENV = "COORDINATOR_RUN_AS_UID"  # set by the launcher for the member only
#: RLIMIT_NPROC of the program under its uid, where no pids cgroup holds it (the launcher's)
NPROC_ENV = "COORDINATOR_PROGRAM_NPROC"
_LOWEST = 1000  # below: the system's own users


def parse_uid_range(text: str) -> range:
    """`"200000-200999"` as a range of uids; ValueError naming the problem."""
    first, dash, last = text.partition("-")
    if not (dash and first.strip().isdigit() and last.strip().isdigit()):
        raise ValueError(f"{text!r} is not FIRST-LAST (two whole numbers)")
    low, high = int(first), int(last)
    if not _LOWEST <= low <= high < 2**31 - 1:
        raise ValueError(f"{text!r}: want {_LOWEST} <= FIRST <= LAST < 2147483647")
    return range(low, high + 1)


def pick_uid(
    uids: range, held: Mapping[str, int], run_id: str, last: int | None = None
) -> int | None:
    """The uid for a member of `run_id`, given the uids running jobs hold (run id -> uid):
    its job's own if one is held, else the first free one after `last` (round the range);
    None when none is free."""
    if run_id in held:
        return held[run_id]
    taken = set(held.values())
    start = 0 if last not in uids else uids.index(last) + 1
    in_turn = [*uids[start:], *uids[:start]]
    return next((uid for uid in in_turn if uid not in taken), None)


def uid_from_environment(environ: Mapping[str, str]) -> int | None:
    """The uid the launcher chose for this member's program, or None (run as ourselves)."""
    text = environ.get(RUN_AS_ENV, "")
    if not text:
        return None
    if not text.isdigit() or int(text) < _LOWEST:
        raise ValueError(f"${RUN_AS_ENV}={text[:20]!r} is not a uid of {_LOWEST} or more")
    if os.geteuid() != 0:
        raise ValueError(f"${RUN_AS_ENV}: running a program as uid {text} needs root")
    return int(text)


def hand_over(path: Path, uid: int, mode: int) -> None:
    """Make `path` the program's (uid and group `uid`), with `mode`, links not followed."""
    os.chown(path, uid, uid, follow_symlinks=False)
    os.chmod(path, mode)


def unreachable_folder(path: Path, uid: int) -> Path | None:
    """The first folder on the way to `path` (itself included) that `uid` cannot enter,
    or None: the program would fail there, so the member says so first."""
    for folder in [*reversed(path.parents), path]:
        info = folder.stat()
        if not stat.S_ISDIR(info.st_mode):
            continue
        if info.st_uid == uid:
            if not info.st_mode & stat.S_IXUSR:
                return folder
        elif info.st_gid == uid:
            if not info.st_mode & stat.S_IXGRP:
                return folder
        elif not info.st_mode & stat.S_IXOTH:
            return folder
    return None


def program_nproc(environ: Mapping[str, str]) -> int | None:
    """The RLIMIT_NPROC the launcher asked for this member's program (None: none)."""
    text = environ.get(NPROC_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"${NPROC_ENV}={text[:20]!r} is not a whole number of at least 1")
    return int(text)
