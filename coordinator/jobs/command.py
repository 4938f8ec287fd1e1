"""The `command` kind: any program as each member, the way torchrun runs a training script.

- Before joining, every member checks the program (not empty, found on PATH or
  executable) and its parameters, so bad input fails every member at once,
  before anything is written to etcd.
- Once the roster is known, each member reserves a port on its roster address
  (a bound socket) and publishes it at `<job>/command/<round>/ports/<rank>`,
  leased; the leader's is MASTER_PORT. After `connect` every member reads them
  all, writes the roster file (0600, never the round's secret), releases its
  port and starts the program under `reaper.py` in a process group of its own,
  with the environment of `environment.program_environment`: etcd only through
  the member's proxy (`coordinator.etcd.proxy`, a unix socket in a 0700 folder),
  which forwards the job's own keys, watches and leases with the member's
  credentials, never the credentials themselves. The member passes
  the program's output on (`relay.py`): its `report` events, never a forged one
  of the member's own.
- While the program runs, the member listens for the job's trouble: a lost
  peer (or its own lease) sends SIGTERM to the program's group, SIGKILL after
  `grace_seconds`, and the member fails naming the lost rank. SIGTERM/SIGINT to
  the member go to the group the same way.
- A program that fails makes its member fail (`ProgramFailed`, naming the rank
  and the status), unless a peer's loss explains it: a collective fails at
  once when a peer dies, while etcd names the dead peer within a TTL, so the
  member waits that long for a loss before blaming its own program.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.etcd.proxy import MAX_SOCKET_PATH, EtcdProxy
from coordinator.etcd.scope import Scope
from coordinator.etcd.txn import KeyValue
from coordinator.etcd.watch import WatchEvent
from coordinator.jobs import catalog
from coordinator.jobs.environment import (
    PROGRAM_DIR,
    PROGRAM_ENV,
    WORKING_DIR_ROOT_ENV,
    check_program_env,
    describe_status,
    program_environment,
    roster_document,
)
from coordinator.jobs.params import artifacts_dir, check_known, float_param
from coordinator.jobs.private_folder import make_private_folder, sweep_private_folders
from coordinator.jobs.program import ProgramGroup
from coordinator.jobs.run_as import (
    NPROC_ENV,
    RUN_AS_ENV,
    hand_over,
    program_nproc,
    uid_from_environment,
    unreachable_folder,
)
from coordinator.keys import job_path, leaf
from coordinator.rendezvous.errors import MemberLost, ProgramFailed, RendezvousError
from coordinator.rendezvous.member import loss_reason

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member

JOB = "command"
DEFAULT_GRACE = catalog.COMMAND_GRACE
MAX_GRACE = catalog.maximum(catalog.COMMAND, "grace_seconds")
#: How long a member waits to hear a finished peer's failure statement (its watch lags).
STATEMENT_GRACE = 2.0
MAX_STATUS = 300  # characters of a program's status said in etcd: how it ended, its last error
PARAMS = catalog.names(catalog.COMMAND)


def check_program(program: Sequence[str]) -> list[str]:
    """The program as a list, checked before joining; ValueError names the problem."""
    program = list(program)
    if not program or not program[0].strip():
        raise ValueError(f"{JOB} job: the program is empty (give it after --: -- PROGRAM ARGS)")
    if shutil.which(program[0]) is None:
        raise ValueError(
            f"{JOB} job: program {program[0]!r} is not found on PATH or is not executable"
        )
    return program


def program_extras(environ: Mapping[str, str]) -> tuple[dict[str, str], Path | None]:
    """The program's extra variables and folder, as the service passed them in the member's
    environment, checked again here: names the member does not set itself, and a folder
    that (links resolved) is an existing one under $COORDINATOR_WORKING_DIR_ROOT (several
    roots separated by os.pathsep). ValueError names the problem, never a value."""
    extra: dict[str, str] = {}
    if environ.get(PROGRAM_ENV):
        try:
            loaded = json.loads(environ[PROGRAM_ENV])
        except ValueError:
            raise ValueError(f"{JOB} job: ${PROGRAM_ENV} is not JSON") from None
        if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
            raise ValueError(f"{JOB} job: ${PROGRAM_ENV} is not a map of names to text")
        extra = check_program_env(loaded)
    folder = environ.get(PROGRAM_DIR)
    if not folder:
        return extra, None
    roots = [r for r in environ.get(WORKING_DIR_ROOT_ENV, "").split(os.pathsep) if r]
    resolved = Path(os.path.realpath(folder))
    inside = [r for r in roots if resolved.is_relative_to(os.path.realpath(r))]
    if not os.path.isabs(folder) or not inside:
        raise ValueError(
            f"{JOB} job: working_dir {folder!r} is not under ${WORKING_DIR_ROOT_ENV} {roots}"
        )
    if not resolved.is_dir():
        raise ValueError(f"{JOB} job: working_dir {folder!r} is not a folder")
    return extra, resolved


def check_reachable(folder: Path, uid: int, what: str) -> None:
    """ValueError naming the folder on the way to `folder` that uid `uid` cannot enter."""
    blocked = unreachable_folder(folder, uid)
    if blocked is not None:
        raise ValueError(
            f"{JOB} job: {what} {folder} is out of reach of the program's uid {uid}: "
            f"{blocked} may not be entered by others (chmod o+x it, or choose another folder)"
        )


def published_ports(kvs: Sequence[KeyValue], world_size: int) -> dict[int, int]:
    """rank -> reserved port, from the keys the members published; anything else there
    (a rank out of range, a port that is not one) is refused, naming the key."""
    ports: dict[int, int] = {}
    for kv in kvs:
        name, value = leaf(kv.key), kv.value.decode(errors="replace")
        if not (name.isdigit() and value.isdigit()):
            raise RuntimeError(f"{kv.key}: not a rank and a port ({value[:20]!r})")
        rank, port = int(name), int(value)
        if rank >= world_size or not 0 < port < 65536:
            raise RuntimeError(f"{kv.key}: rank {rank} or port {port} out of range")
        ports[rank] = port
    return ports


def failures(kvs: Sequence[KeyValue], world_size: int) -> dict[int, tuple[float, int, str]]:
    """rank -> (when its program ended, revision, status) of the programs that failed, from
    the keys their members wrote; anything else there is skipped (never trusted)."""
    found: dict[int, tuple[float, int, str]] = {}
    for kv in kvs:
        name = leaf(kv.key)
        try:
            said = json.loads(kv.value)
            status, at = said["status"], said["at"]
        except (ValueError, TypeError, KeyError):
            continue
        if not (name.isdigit() and int(name) < world_size and isinstance(status, str)):
            continue
        if type(at) in (int, float) and math.isfinite(at):
            found[int(name)] = (float(at), kv.create_revision, status[:MAX_STATUS])
    return found


def failed_in_program(state: Mapping[str, object]) -> bool:
    """Whether a member's last state says its program failed (it was not killed)."""
    return state.get("state") == "failed" and state.get("phase") == "program"


class CommandJob:
    """One member's side of the job (see the module docstring)."""

    def __init__(self, params: dict[str, str], world_size: int, program: Sequence[str]) -> None:
        check_known(JOB, params, PARAMS)
        self.program = check_program(program)
        self.world_size = world_size
        #: How long stopping the program may take; the worker's watchdog waits this much more.
        self.stop_grace = float_param(JOB, params, "grace_seconds", DEFAULT_GRACE, MAX_GRACE)
        self.artifacts_root = artifacts_dir(JOB, params)
        on_loss = params.get("on_loss", "fail")
        if on_loss not in ("fail", "continue"):
            raise ValueError(f"{JOB} job: parameter on_loss={on_loss!r} is not fail or continue")
        #: A lost member leaves the job instead of stopping every program (`on_loss=continue`,
        #: for programs whose `ctx.steps(on_loss="continue")` carry on without it).
        self.carry_on = on_loss == "continue"
        self.extra_env, self.working_dir = program_extras(os.environ)
        #: The uid the program runs under (the launcher's choice), or None: the member's.
        self.run_as = uid_from_environment(os.environ)
        self.nproc = program_nproc(os.environ) if self.run_as is not None else None
        if self.run_as is not None and self.working_dir is not None:
            check_reachable(self.working_dir, self.run_as, "working_dir")
        #: The `training` barrier waits for the slowest program, as torchrun does
        #: (a lost member still ends the wait at once).
        self.training_timeout = float("inf")
        self._reserved: socket.socket | None = None
        self._private: Path | None = None
        self._proxy: EtcdProxy | None = None
        self._proxy_folder: Path | None = None
        self._group: ProgramGroup | None = None
        self._wake = threading.Event()
        self._ended_at = 0.0  # when the program ended (wall clock: compared across hosts)
        self._trouble: RendezvousError | None = None

    # -- before connect ---------------------------------------------------

    def on_roster(self, member: Member) -> None:
        member.on_trouble(self._on_trouble)
        roster, rank = member.roster, member.rank
        assert roster is not None and rank is not None
        host = roster.members[rank].host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._reserved = sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))  # bound, never listening: held until the program starts
        port = sock.getsockname()[1]
        member.etcd.put(member.keys.command_port(member.round, rank), str(port), member.lease_id)

    def _on_trouble(self, error: RendezvousError) -> None:
        self._trouble = error
        self._wake.set()

    # -- the program ------------------------------------------------------

    def run(self, member: Member) -> dict[str, object]:
        roster, rank = member.roster, member.rank
        assert roster is not None and rank is not None
        kvs, _ = member.etcd.get_prefix(member.keys.command_ports(member.round))
        ports = published_ports(kvs, self.world_size)
        missing = sorted(set(range(self.world_size)) - set(ports))
        if missing:
            raise RuntimeError(f"ranks {missing} published no reserved port before connect")
        artifacts = self.artifacts_root / member.job_id
        artifacts.mkdir(parents=True, exist_ok=True)
        self._private = make_private_folder(member.job_id)
        roster_file = self._private / "roster.json"
        fd = os.open(roster_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(roster_document(roster, ports), handle, indent=1)
        if self.run_as is not None:  # the program's own: these files, and nothing else of ours
            check_reachable(artifacts.parent, self.run_as, "artifacts")
            check_reachable(self._private.parent, self.run_as, "the temporary folder")
            hand_over(artifacts, self.run_as, 0o700)  # no other job's programs may write it
            os.chmod(self._private, 0o711)  # enterable, not listable: the files stay private
            hand_over(roster_file, self.run_as, 0o600)
        hidden = (PROGRAM_ENV, PROGRAM_DIR, RUN_AS_ENV, NPROC_ENV)
        base = {k: v for k, v in os.environ.items() if k not in hidden}
        env = program_environment(
            {**base, **self.extra_env},
            roster=roster,
            rank=rank,
            ports=ports,
            roster_file=roster_file,
            artifacts=artifacts,
            etcd_endpoints=self._start_proxy(member).endpoint,
            namespace=member.etcd.namespace,
            lease=member.lease_id,
            etcd_wait=member.etcd.retry_window,
        )
        if self.carry_on:  # from connect on: every member started its program
            member.carry_on_without_lost()
        self._release_port()  # free when the program starts
        member.phase = "program"
        group = ProgramGroup(
            self.program, env, self.working_dir, rank=rank, user=self.run_as, nproc=self.nproc
        )
        return self._supervise(member, group)

    def _start_proxy(self, member: Member) -> EtcdProxy:
        """The program's way to etcd: a proxy on a 0600 socket in a folder of this member's
        (its private folder, or a shorter one when that path would not fit a socket), the
        program's uid's when it runs under one of its own."""
        assert self._private is not None
        folder = self._private
        if len(str(folder / "etcd.sock")) > MAX_SOCKET_PATH:
            self._proxy_folder = folder = make_private_folder("etcd", root="/tmp")
        scope = Scope(
            f"{member.etcd.namespace}/{job_path(member.job_id)}".encode(),
            attachable=frozenset({member.lease_id}),
        )
        self._proxy = EtcdProxy(member.etcd, scope, folder / "etcd.sock").start()
        if self.run_as is not None:  # the program's uid connects; nobody else's
            if folder is not self._private:
                os.chmod(folder, 0o711)  # enterable, not listable, like the private folder
            hand_over(self._proxy.socket_path, self.run_as, 0o600)
        return self._proxy

    def _supervise(self, member: Member, group: ProgramGroup) -> dict[str, object]:
        self._group = group
        threading.Thread(target=self._wait_for_exit, args=(group,), daemon=True).start()
        try:
            self._wake.wait()
        except KeyboardInterrupt:
            group.stop(self.stop_grace, signal.SIGINT)
            raise
        except BaseException:  # SIGTERM to the member (the worker's Terminated), or worse
            group.stop(self.stop_grace, signal.SIGTERM)
            raise
        if self._trouble is not None:  # a lost peer, or our own lease: stop the program
            group.stop(self.stop_grace)
            raise self._trouble
        code = group.poll()
        assert code is not None
        group.stop(self.stop_grace)  # what the program left behind in its group
        if code != 0:
            last = group.relay.last_error
            raise self._cause(member, describe_status(code) + (f" ({last})" if last else ""))
        return {"rank": member.rank, "exit_code": 0, "program": self.program[0]}

    def _cause(self, member: Member, status: str) -> RendezvousError:
        """Why this member's program failed. A program often fails because a peer's did (a
        collective's socket closed), so every member whose program fails says in etcd when
        it ended; the one that ended first is named, then the others in order (hosts'
        clocks are assumed in step to well under the time a failure takes to spread).
        Once every member's program failed and said so, that is known at once (a member
        seen gone after failing is waited for a moment: its statement may still be on its
        way through our watch). Otherwise a member waits up to a TTL + 2 s for a lost
        member (killed: it says nothing) and names that, or else the failures seen (its
        own among them). A member gone after its program failed (its key's last state
        says so) is not a loss here: it failed like us."""
        rank = member.rank or 0
        prefix = member.keys.command_failures(member.round)
        ended = self._ended_at
        said = json.dumps({"status": status[:MAX_STATUS], "at": ended})
        revision = member.etcd.put(
            member.keys.command_failure(member.round, rank), said, member.lease_id
        )
        mine = (ended, revision)
        changed, lock = threading.Event(), threading.Lock()
        seen: dict[int, tuple[float, int, str]] = {}  # kept: a member gone takes its key along

        def heard(events: list[WatchEvent]) -> None:
            said = [KeyValue(e.key, e.value, e.create_revision, e.revision, 0) for e in events
                    if e.kind == "put"]  # fmt: skip
            with lock:
                seen.update(failures(said, self.world_size))
            changed.set()

        member.on_trouble(lambda _: changed.set())
        # From the round's start: every failure said in this round, even one whose member
        # has left since (its key went with its lease).
        watch = member.etcd.watch(prefix, heard, member.round, prefix=True, prev_kv=False)
        deadline = time.monotonic() + member.ttl + 2.0
        try:
            while True:
                now = failures(member.etcd.get_prefix(prefix)[0], self.world_size)
                with lock:
                    seen.update(now)
                    failed = dict(seen)
                gone = member.losses()
                alike = {r for r, state in gone.items() if failed_in_program(state)}
                lost = sorted(set(gone) - alike - set(failed))
                if lost:
                    return MemberLost(lost[0], "program", loss_reason(gone[lost[0]]))
                if len(set(failed) | alike) == self.world_size and len(failed) < self.world_size:
                    # Every member is done, but some failures are not heard yet: a member's
                    # statement is put before its key leaves, so the watch brings it soon.
                    deadline = min(deadline, time.monotonic() + STATEMENT_GRACE)
                remaining = deadline - time.monotonic()
                if len(failed) == self.world_size or remaining <= 0:
                    failed[rank] = (*mine, status)
                    order = sorted(failed, key=lambda r: failed[r][:2])
                    first, then = order[0], order[1:]
                    # Which ended first is a hint (a program's exit can lag its failure):
                    # every failure is named, in the order the programs ended.
                    also = "".join(f"; then rank {r}'s {failed[r][2]}" for r in then)
                    return ProgramFailed(first, failed[first][2] + also)
                changed.wait(remaining)
                changed.clear()
        finally:
            watch.cancel()

    def _wait_for_exit(self, group: ProgramGroup) -> None:
        group.wait()
        self._ended_at = time.time()
        self._wake.set()

    def _release_port(self) -> None:
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None

    def close(self) -> None:
        self._release_port()
        if self._group is not None:
            self._group.stop(self.stop_grace)
            self._group = None
        if self._proxy is not None:  # (after the program: nothing calls through it now)
            self._proxy.close()
            self._proxy = None
        if self._proxy_folder is not None:
            shutil.rmtree(self._proxy_folder, ignore_errors=True)
            self._proxy_folder = None
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            sweep_private_folders(self._private.parent)  # a killed peer's, say
            self._private = None
