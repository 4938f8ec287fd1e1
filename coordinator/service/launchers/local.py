"""Members as local processes: the service's embedded default.

Each member is `python -m coordinator worker ...` in a session of its own, its
stdout and stderr appended to one log file
(`<logs>/<job>-<uid>/attempt-<n>/member-<i>.log`), so it outlives the service that
started it and writes to nothing that dies with it (a pipe would). A pidfile
beside the log, written at once, makes `start` idempotent and lets a restarted
service find a member its predecessor started but never recorded.

Nothing a job record says is taken on trust. Its member's files are found from
the record's validated run id, attempt and index, under the logs folder (checked
with `..` and links resolved), never from a path it names. A pid is signalled
only when the pidfile `start` wrote for that member names the same pid and start
time, and the process with that pid started then: a record cannot point the
launcher at any other process, and a reused pid is never taken for a member.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from coordinator.etcd.users import Credentials, write_password_file
from coordinator.events import Done, Failed, parse_event, split_lines
from coordinator.files import write_private
from coordinator.jobs.run_as import NPROC_ENV, RUN_AS_ENV, pick_uid
from coordinator.launch import WorkerCommand
from coordinator.launch.local import start_process
from coordinator.launch.pids import (
    InCgroup,
    MemberCgroups,
    ProcessLimit,
    Unbounded,
    local_plan,
)
from coordinator.service.launchers import (
    NOTHING,
    OUTPUT_CAP,
    VANISHED,
    Launch,
    OnDemandLauncher,
    Reservation,
    member_command,
)
from coordinator.service.model import Member

log = logging.getLogger(__name__)

START_TOLERANCE = 0.05  # seconds: psutil's create_time counts clock ticks (10 ms)
MAX_ATTEMPT = 999
_FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # one path part, never ..
_LOG_PATH = re.compile(
    r"(?P<run>[^/]+)/attempt-(?P<attempt>[0-9]{1,3})/member-(?P<index>[0-9]{1,4})\.log"
)


class LocalLauncher(OnDemandLauncher):
    def __init__(
        self,
        logs: Path,
        die_with_parent: bool = False,
        workdir: Path | None = None,
        extra_env: dict[str, str] | None = None,
        gpus: tuple[int, ...] = (),
        run_as: range | None = None,
        pids_limit: int | None = None,
    ) -> None:
        """`die_with_parent`: members are killed when the thread that started them ends
        (an agent's members die with it); the service's members outlive it instead.
        `workdir`: where members run [ours] (an agent's data dir: relative paths stay in it).
        `extra_env`: set for every member (an agent's working-dir roots).
        `gpus`: the GPU ids members of jobs with `gpus_per_worker` get (`serve --gpus`);
        which a member holds is in its pidfile, so a restarted service knows them too.
        `run_as`: the uids programs run under, one per job (`coordinator.jobs.run_as`);
        which a job holds is in its members' pidfiles, as GPUs are.
        `pids_limit`: each member's processes and threads, in a pids cgroup of its own
        (None: unbounded, as `coordinator run`'s test helpers start them)."""
        self.logs = logs
        self.extra_env = dict(extra_env or {})
        self.die_with_parent = die_with_parent
        self.workdir = workdir
        self.gpus = gpus
        self.run_as = run_as
        self._last_uid: int | None = None  # the uid given last: the next job takes the next
        self._children: dict[int, subprocess.Popen[bytes]] = {}  # pid -> our own child
        self.cgroups: MemberCgroups | None = None
        self.program_nproc: int | None = None  # RLIMIT_NPROC of programs under run_as uids
        if pids_limit is not None:
            plan = local_plan(pids_limit, dedicated_uid=run_as is not None)
            if isinstance(plan, ProcessLimit):
                self.program_nproc = plan.limit
            elif isinstance(plan, InCgroup):
                self.cgroups = MemberCgroups(plan, logs)
                self.cgroups.sweep()  # what ended while no launcher watched
            elif isinstance(plan, Unbounded):
                log.warning("%s", plan.why)

    def folder(self, run_id: str, attempt: int) -> Path:
        """Where attempt `attempt` of `run_id` keeps its members' output and pidfiles; a run
        id or attempt that could name a folder anywhere else is refused (ValueError)."""
        if not _FOLDER_NAME.fullmatch(run_id) or not 1 <= attempt <= MAX_ATTEMPT:
            raise ValueError(f"run id {run_id!r}, attempt {attempt}: not a member folder")
        return self._within(self.logs / run_id / f"attempt-{attempt}")

    def reserve(self, launch: Launch) -> Reservation | None:
        """Room always (the service's --max-workers is the limit), unless the job asks for
        more GPUs than running members leave free: then it waits."""
        wanted = launch.spec.gpus_per_worker * launch.spec.workers
        if wanted and len(self.free_gpus()) < wanted:
            return None
        if self.run_as and pick_uid(self.run_as, self.held_uids(), launch.run_id) is None:
            return None
        return NOTHING

    def held_uids(self) -> dict[str, int]:
        """run id -> the uid its running members' programs run under (their pidfiles)."""
        held: dict[str, int] = {}
        for pidfile in self.logs.glob("*/attempt-*/member-*.pid"):
            with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                written = json.loads(pidfile.read_text())
                member = Member(index=0, pid=written["pid"], started=written["started"])
                uid = written.get("uid")
                if isinstance(uid, int) and self._running(member):
                    held[pidfile.parent.parent.name] = uid
        return held

    def free_gpus(self) -> list[int]:
        """The GPUs of `self.gpus` no running member holds (as its pidfile says)."""
        if not self.gpus:
            return []
        held: set[int] = set()
        for pidfile in self.logs.glob("*/attempt-*/member-*.pid"):
            with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                written = json.loads(pidfile.read_text())
                member = Member(index=0, pid=written["pid"], started=written["started"])
                gpus = written.get("gpus", [])
                if gpus and self._running(member):
                    held.update(g for g in gpus if isinstance(g, int))
        return [gpu for gpu in self.gpus if gpu not in held]

    def start(self, launch: Launch, index: int) -> Member:
        command = launch.command
        wanted = launch.spec.gpus_per_worker
        started = self.folder(launch.run_id, launch.attempt) / f"member-{index}.pid"
        if wanted and not started.exists():  # whole GPUs no running member holds
            free = self.free_gpus()
            if len(free) < wanted:
                raise RuntimeError(f"member {index}: {wanted} GPUs are not free (of {free})")
            command = command.model_copy(update={"gpus": tuple(free[:wanted])})
        return self.start_member(launch.run_id, launch.attempt, index, command, launch.credentials)

    def start_member(
        self,
        run_id: str,
        attempt: int,
        index: int,
        command: WorkerCommand,
        credentials: Credentials | None = None,
    ) -> Member:
        """Start `command` as member `index` of that attempt (or find it started), as the
        job's etcd user when `credentials` are given (its password in a file of its own)."""
        folder = self.folder(run_id, attempt)
        self.logs.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        pidfile = folder / f"member-{index}.pid"
        log = folder / f"member-{index}.log"
        if pidfile.exists():  # started before: never start it twice
            written = json.loads(pidfile.read_text())
            identity = {"pid": written["pid"], "started": written["started"]}
            return Member(index=index, log=str(log), **identity)
        password_file = folder / f"member-{index}.password"
        if credentials is not None:  # the job's etcd user, for this member only
            write_password_file(password_file, credentials.password)
        command = member_command(command, credentials, password_file)
        extra_env = {"COORDINATOR_PORT": "0", **self.extra_env}
        uid = None
        if self.run_as:  # the job's uid on this host: its members share it, no other job has it
            uid = pick_uid(self.run_as, self.held_uids(), run_id, self._last_uid)
            if uid is None:
                raise RuntimeError(f"member {index}: every uid of {self.run_as} is taken")
            self._last_uid = uid
            extra_env[RUN_AS_ENV] = str(uid)
            if self.program_nproc is not None:  # no cgroup here: the uid's own limit
                extra_env[NPROC_ENV] = str(self.program_nproc)
        cgroup = None
        if self.cgroups is not None:
            self.cgroups.retry()
            try:
                cgroup = self.cgroups.create(cgroup_name(run_id, attempt, index))
            except OSError as exc:
                raise RuntimeError(f"member {index}: cannot make its pids cgroup: {exc}") from None
        with open(log, "ab") as output:
            process = start_process(
                command,
                stdout=output,
                stderr=subprocess.STDOUT,
                own_session=True,  # its own process group: it outlives us, signalled whole
                die_with_parent=self.die_with_parent,
                cwd=self.workdir,
                # Port 0: members on one host must not share the image's fixed port.
                extra_env=extra_env,
                cgroup=cgroup,
            )
        self._children[process.pid] = process
        identity = {"pid": process.pid, "started": _start_time(process.pid)}
        write_private(pidfile, json.dumps({**identity, "gpus": list(command.gpus), "uid": uid}))
        return Member(index=index, log=str(log), **identity)

    def exit_code(self, member: Member) -> int | None:
        """None while the member runs; then its exit status if it was our child, else the
        code its last event gave (`VANISHED` when none did). A member this launcher cannot
        vouch for (see `_vouched`) is never taken for running: it reads as ended. Once it
        has ended, its password file is deleted: nothing may read it after the member."""
        if self.cgroups is not None:
            self.cgroups.retry()  # an ended member's cgroup that a leaving process held
        code = self._exit_code(member)
        if code is not None:
            self._forget_password(member)
        return code

    def _forget_password(self, member: Member) -> None:
        files = self._files(member)
        if files is not None:
            with contextlib.suppress(FileNotFoundError, ValueError):
                self._within(files.log.with_suffix(".password")).unlink()

    def _exit_code(self, member: Member) -> int | None:
        if member.pid is not None and self._vouched(member):
            child = self._children.get(member.pid)
            if child is not None:
                code = child.poll()
                if code is None:
                    return None
                del self._children[member.pid]
                self._release(member)
                return 128 - code if code < 0 else code  # killed by signal n: 128 + n
            if self._running(member):
                return None
            self._release(member)  # the member it vouches for has ended
        return _last_word(self.output(member, 0))

    def terminate(self, member: Member) -> None:
        self._signal(member, signal.SIGTERM)

    def kill(self, member: Member) -> None:
        self._signal(member, signal.SIGKILL)

    def output(self, member: Member, offset: int) -> bytes:
        files = self._files(member)
        if files is None:
            return b""
        try:
            with open(self._within(files.log), "rb") as log:
                log.seek(max(0, offset))
                return log.read(OUTPUT_CAP)
        except (FileNotFoundError, ValueError):
            return b""

    def remove(self, run_id: str) -> int:
        """Delete the submission's folder (its members' logs and pidfiles); how many logs
        it held. A run id that names no folder under the logs folder is refused
        (ValueError): nothing outside it is ever removed."""
        if not _FOLDER_NAME.fullmatch(run_id):
            raise ValueError(f"run id {run_id!r} cannot name a folder")
        folder = self._within(self.logs / run_id)
        logs = len(list(folder.glob("*/member-*.log")))
        shutil.rmtree(folder, ignore_errors=True)
        if self.cgroups is not None:
            self.cgroups.release_run(run_id)
        return logs

    def _release(self, member: Member) -> None:
        """Remove the ended member's cgroup (killing what it left running), if it is ours."""
        files = self._files(member) if self.cgroups is not None else None
        if self.cgroups is None or files is None:
            return
        run_id, attempt = files.log.parent.parent.name, files.log.parent.name
        try:
            if not self.cgroups.release(f"{run_id}.{attempt}.{member.index}"):
                log.info("member %s of %s: its cgroup still holds processes", member.index, run_id)
        except OSError as exc:
            log.warning("member %s of %s: cannot remove its cgroup: %s", member.index, run_id, exc)

    # -- which process is the member's --------------------------------------------------

    def _signal(self, member: Member, signum: int) -> None:
        """Signal the member's process group, only if its process is the one this launcher
        started for that member and it still runs."""
        pid = member.pid
        if pid is None or not self._vouched(member) or not self._running(member):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:  # the leader of the session `start` gave it
                os.killpg(pid, signum)

    def _vouched(self, member: Member) -> bool:
        """The record's pid and start time are the ones `start` wrote into the member's
        pidfile: a record cannot point this launcher at any other process."""
        files = self._files(member)
        if files is None:
            return False
        try:
            written = json.loads(self._within(files.pidfile).read_text())
        except (OSError, ValueError):
            return False
        return same_identity(member, written)

    def _running(self, member: Member) -> bool:
        """The process with the member's pid started when the member did and has not
        ended (a reused pid, an unknown start time or a zombie: not running)."""
        if member.pid is None or member.started is None:
            return False
        try:
            process = psutil.Process(member.pid)
            return started_together(process.create_time(), member.started) and (
                process.status() != psutil.STATUS_ZOMBIE
            )
        except psutil.NoSuchProcess:
            return False

    def _files(self, member: Member) -> MemberFiles | None:
        """The member's log and pidfile, derived from the run id, attempt and index of
        its record (`Member.log`: relative to the logs folder, or as `start` returned it)
        and the member's own index; None when that names no member folder of ours."""
        if member.log is None:
            return None
        where = member.log
        root = f"{self.logs}{os.sep}"
        if where.startswith(root):
            where = where[len(root) :]
        match = _LOG_PATH.fullmatch(where)
        if match is None or int(match["index"]) != member.index:
            return None
        try:
            folder = self.folder(match["run"], int(match["attempt"]))
        except ValueError:
            return None
        name = f"member-{member.index}"
        return MemberFiles(folder / f"{name}.log", folder / f"{name}.pid")

    def _within(self, path: Path) -> Path:
        """`path`, if it lies under the logs folder once `..` and links are resolved;
        else ValueError."""
        root = self.logs.resolve()
        resolved = path.resolve()
        if resolved == root or not resolved.is_relative_to(root):
            raise ValueError(f"{path} is not under {self.logs}")
        return path


class MemberFiles(NamedTuple):
    log: Path
    pidfile: Path


def cgroup_name(run_id: str, attempt: int, index: int) -> str:
    """The member's cgroup's name: its folder's parts, which `folder` has checked."""
    return f"{run_id}.attempt-{attempt}.{index}"


def same_identity(member: Member, written: Any) -> bool:
    """`written` (a pidfile's content) names the member's pid and start time."""
    return (
        isinstance(written, dict)
        and written.get("pid") == member.pid
        and written.get("started") == member.started
    )


def started_together(create_time: float, started: float) -> bool:
    """A process created at `create_time` is the one recorded as started at `started`."""
    return abs(create_time - started) < START_TOLERANCE


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:  # it ended already: its exit code says how
        return None


def _last_word(output: bytes) -> int:
    """The exit code a member's last event gave (`failed` carries it; `done` is 0)."""
    for line in reversed(split_lines(output)):
        event = parse_event(line)
        if isinstance(event, Failed):
            return event.exit_code
        if isinstance(event, Done):
            return 0
    return VANISHED
