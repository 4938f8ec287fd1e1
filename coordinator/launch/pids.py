"""A local member's processes and threads, bounded: a pids cgroup of its own.

A member that starts threads without end (an OpenMP pool told 1,000,000, a program's
fork bomb) would take every thread the host allows, and the service's etcd with them.
So each local member (the service's, an agent's) starts in a cgroup of its own whose
`pids.max` is the limit: cgroup v1's pids hierarchy where it is mounted and ours to
write, else cgroup v2 where our own cgroup hands the pids controller down. The member
joins it before it runs a line of its own (a `sh` prelude writes its pid, then execs),
so nothing it starts is ever outside. The cgroup is removed when the member has ended,
and any process left in it is killed first: nothing orphaned, neither cgroup nor process.

Where no cgroup is ours, RLIMIT_NPROC bounds a member only when it runs under a uid of
its own (the limit counts every process of the uid: under ours it would count the
service's threads too); otherwise members run unbounded and the launcher logs one
warning. Which of these applies is `choose`, pure; the rest reads and writes /sys.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_PIDS_LIMIT = 1024  # PyTorch and gRPC start dozens of threads per process
MOUNTINFO = Path("/proc/self/mountinfo")
OWN_CGROUP = Path("/proc/self/cgroup")
#: Joins the cgroup whose `cgroup.procs` is $1, then becomes the rest of argv (its pid,
#: and so its start time and process group, stay the member's). 125: it could not join.
_JOIN = 'echo $$ > "$1" || exit 125; shift; exec "$@"'
#: RLIMIT_NPROC for a program under a uid of its own, where no cgroup bounds its member
#: (set by the launcher for the member; the reaper sets it as it drops to the uid).
SERVICE_LEAF = "service"  # cgroup v2: where we move ourselves to hand pids down


@dataclass(frozen=True)
class CgroupParent:
    """A folder of the pids controller we may make cgroups in (`version` 1 or 2)."""

    path: Path
    version: int


@dataclass(frozen=True)
class InCgroup:
    """Each member in a cgroup of its own under `parent`, with `pids.max` = `limit`."""

    parent: Path
    limit: int
    version: int = 1  # of the cgroup hierarchy `parent` is in


@dataclass(frozen=True)
class ProcessLimit:
    """RLIMIT_NPROC = `limit` for a member under a uid of its own."""

    limit: int


@dataclass(frozen=True)
class Unbounded:
    """No limit can be set here; `why` is the warning to log once."""

    why: str


Plan = InCgroup | ProcessLimit | Unbounded


def choose(parent: CgroupParent | None, dedicated_uid: bool, limit: int) -> Plan:
    """How members are bounded: a cgroup where one is ours, else RLIMIT_NPROC for a member
    under its own uid, else nothing (and why)."""
    if parent is not None:
        return InCgroup(parent.path, limit, parent.version)
    if dedicated_uid:
        return ProcessLimit(limit)
    return Unbounded(
        "members run without a process or thread limit: no pids cgroup here is writable "
        "(cgroup v1's pids hierarchy, or a cgroup v2 one delegated to this service), and "
        "they share this service's uid, so RLIMIT_NPROC would count its threads too"
    )


def find_parent(mountinfo: str, own_cgroups: str) -> list[CgroupParent]:
    """Where the pids controller could hold our members, best first, from the texts of
    /proc/self/mountinfo and /proc/self/cgroup: our own cgroup in v1's pids hierarchy,
    then our own cgroup in v2's. Whether each is writable is for `usable_parent` to see."""
    own_v1 = own_v2 = None
    for line in own_cgroups.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            own_v2 = path
        elif "pids" in controllers.split(","):
            own_v1 = path
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        root, mount_point = fields[3], fields[4]
        after = line.split(" - ", 1)[1].split()
        fstype, options = after[0], (after[2] if len(after) > 2 else "")
        if fstype == "cgroup" and "pids" in options.split(",") and own_v1 is not None:
            found.append(CgroupParent(_under(mount_point, root, own_v1), 1))
        elif fstype == "cgroup2" and own_v2 is not None:
            found.append(CgroupParent(_under(mount_point, root, own_v2), 2))
    return sorted(found, key=lambda parent: parent.version)


def _under(mount_point: str, root: str, own: str) -> Path:
    """Our cgroup `own` (as /proc/self/cgroup names it) as a path under the mount of
    hierarchy folder `root` (a container sees its own cgroup as the mount's root)."""
    relative = os.path.relpath(own, root) if own.startswith(root) else own.lstrip("/")
    return Path(mount_point) / ("" if relative == "." else relative.lstrip("/"))


def usable_parent(candidates: list[CgroupParent]) -> CgroupParent | None:
    """The first candidate we may make cgroups with a pids limit in: v1, a folder we
    can write; v2, one whose children get the pids controller (turned on if we may)."""
    for parent in candidates:
        if not os.access(parent.path, os.W_OK | os.X_OK):
            continue
        if parent.version == 1:
            return parent
        try:
            if delegate_pids(parent.path, os.getpid()):
                return parent
        except OSError:
            continue
    return None


def delegate_pids(own: Path, pid: int) -> bool:
    """Hand cgroup v2's pids controller down from our own cgroup `own` to the cgroups we
    make in it. A cgroup with processes cannot hand controllers down, so when we are the
    only process in `own` we move into a leaf of it (`service`) first, as a delegated
    service should; with any other process in it, we leave it be (False)."""
    subtree = own / "cgroup.subtree_control"
    if "pids" in subtree.read_text().split():
        return True
    if "pids" not in (own / "cgroup.controllers").read_text().split():
        return False
    procs = (own / "cgroup.procs").read_text().split()
    if procs and procs != [str(pid)]:
        return False  # not ours alone: moving them is not ours to do
    if procs:
        leaf = own / SERVICE_LEAF
        leaf.mkdir(exist_ok=True)
        (leaf / "cgroup.procs").write_text(str(pid))
    subtree.write_text("+pids")
    return True


def local_plan(limit: int, dedicated_uid: bool = False) -> Plan:
    """This host's plan for members with `limit` processes and threads each."""
    try:
        candidates = find_parent(MOUNTINFO.read_text(), OWN_CGROUP.read_text())
    except OSError:
        candidates = []
    return choose(usable_parent(candidates), dedicated_uid, limit)


class MemberCgroups:
    """The launcher's members' cgroups: `<parent>/coordinator-<tag>/<member>`, `tag` from
    the launcher's folder, so a restarted service finds its predecessor's members."""

    def __init__(self, plan: InCgroup, owner: Path) -> None:
        tag = hashlib.sha256(str(owner.resolve()).encode()).hexdigest()[:12]
        self.base = plan.parent / f"coordinator-{tag}"
        self.limit = plan.limit
        self.version = plan.version
        self._left: set[str] = set()  # released while a process was still leaving

    def create(self, name: str) -> Path:
        """The member's cgroup, made (or found) with its limit set; OSError when not."""
        group = self._path(name)
        if self.version == 2:  # v2: the base hands the controller down to its members
            self.base.mkdir(exist_ok=True)
            (self.base / "cgroup.subtree_control").write_text("+pids")
        group.mkdir(parents=True, exist_ok=True)  # the base too: `release` removes it empty
        (group / "pids.max").write_text(str(self.limit))
        return group

    def release(self, name: str) -> bool:
        """Remove the member's cgroup (it has ended): any process left in it is killed
        first, and the launcher's base once no member is left in it. False while a
        process still lingers (try again later)."""
        gone = remove_cgroup(self._path(name))
        if gone:
            self._left.discard(name)
            with contextlib.suppress(OSError):  # another member's cgroup is in it
                self.base.rmdir()
        else:
            self._left.add(name)
        return gone

    def retry(self) -> None:
        """Release again what `release` could not remove yet (a process was leaving)."""
        for name in list(self._left):
            with contextlib.suppress(OSError):
                self.release(name)

    def release_run(self, run_id: str) -> None:
        """Remove every cgroup of the submission `run_id` (its job was deleted)."""
        pattern = re.compile(re.escape(run_id) + r"\.attempt-[0-9]{1,3}\.[0-9]{1,4}")
        with contextlib.suppress(FileNotFoundError):
            for group in self.base.iterdir():
                if pattern.fullmatch(group.name):
                    remove_cgroup(group)
            with contextlib.suppress(OSError):
                self.base.rmdir()

    def sweep(self) -> int:
        """Remove the cgroups of members that ended while nobody watched (a restarted
        service's predecessor's); a cgroup with a process in it stays. How many went."""
        removed = 0
        with contextlib.suppress(FileNotFoundError):
            for group in self.base.iterdir():
                if group.is_dir() and not _procs(group) and _rmdir(group):
                    removed += 1
            with contextlib.suppress(OSError):
                self.base.rmdir()
        return removed

    def _path(self, name: str) -> Path:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"member cgroup name {name!r} is not one path part")
        return self.base / name


def join_argv(group: Path, argv: list[str]) -> list[str]:
    """`argv`, run in cgroup `group` from its first instruction on."""
    return ["/bin/sh", "-c", _JOIN, "coordinator-pids", str(group / "cgroup.procs"), *argv]


def remove_cgroup(group: Path, wait: float = 0.5) -> bool:
    """SIGKILL whatever is left in `group`, give it up to `wait` seconds to leave, then
    remove the group; True once it is gone (False: a process is still leaving)."""
    left = _procs(group)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = _procs(group)
    return _rmdir(group)


def _procs(group: Path) -> list[int]:
    try:
        return [int(line) for line in (group / "cgroup.procs").read_text().split()]
    except (FileNotFoundError, ValueError):
        return []


def _rmdir(group: Path) -> bool:
    try:
        group.rmdir()
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno == errno.EBUSY:  # a process still in it (dying): not yet
            return False
        raise
    return True
