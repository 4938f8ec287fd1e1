"""A member's private folder (0700) for what its program must read but nobody else:
the roster file, with every member's address and pid.

A member removes its folder when it closes; one killed by SIGKILL cannot. So
each folder's name carries its member's pid, and every member, as it makes its
own and as it removes it, removes those of its user whose process is gone: a
killed member's folder goes when its peers stop or the next member starts.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

PREFIX = "coordinator-p"
_NAME = re.compile(rf"^{PREFIX}(\d{{1,10}})-")


def make_private_folder(job_id: str, root: str | None = None) -> Path:
    """A new 0700 folder named for this process, after sweeping the dead ones."""
    parent = Path(root or tempfile.gettempdir())
    sweep_private_folders(parent)
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{job_id}-", dir=parent))


def sweep_private_folders(parent: Path) -> list[Path]:
    """Remove the private folders in `parent` that belong to this user and name a
    process that no longer runs; what was removed."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        found = _NAME.match(entry.name)
        if found is None or _alive(int(found.group(1))):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not entry.is_dir(follow_symlinks=False) or info.st_uid != os.getuid():
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a name we made: leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
