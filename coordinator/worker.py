"""One member's whole life as a process: the body of `coordinator worker`.

It reports progress as JSON lines on stdout (one per phase passed, then a
final `done` or `failed` line), so a launcher can follow N workers without
reading etcd, and a human can read container logs. The exit code says what
went wrong (see `EXIT_CODES`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from coordinator.etcd.client import Etcd
from coordinator.etcd.connection import parse_endpoints
from coordinator.etcd.errors import EtcdError, EtcdUnavailable
from coordinator.etcd.names import check_name
from coordinator.events import Done, Failed, Phase, RosterView, TimelineEntry, emit
from coordinator.exit_codes import (
    EXIT_ERROR,
    EXIT_ETCD_UNAVAILABLE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
)
from coordinator.jobs import MEMBER_KINDS, make_job
from coordinator.keys import job_path
from coordinator.rendezvous.errors import (
    JobFull,
    MemberLost,
    ProgramFailed,
    RendezvousError,
    RendezvousTimeout,
    SessionLost,
    Unreachable,
)
from coordinator.rendezvous.member import Member
from coordinator.rendezvous.roster import check_world_size

#: Exit code -> meaning; part of the CLI's interface, and its only table
#: (`coordinator exit-codes` prints it; the docs point there).
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "the member passed every phase and cleaned up",
    EXIT_ERROR: "an unexpected error (message on stderr)",
    EXIT_USAGE: "bad arguments; the message names the field",
    EXIT_ETCD_UNAVAILABLE: (
        "etcd could not be reached within the connect timeout, or refused the TLS or auth "
        "settings: a missing client certificate, an untrusted server, wrong credentials, or "
        "no permission on the namespace (the message names which; docs/security.md)"
    ),
    JobFull.exit_code: "JobFull: the job already has all its members",
    MemberLost.exit_code: "MemberLost: another member died, lost etcd or failed",
    RendezvousTimeout.exit_code: (
        "RendezvousTimeout: a phase passed its deadline; the message names who was missing"
    ),
    SessionLost.exit_code: "SessionLost: this member lost its own etcd lease and stopped",
    Unreachable.exit_code: "Unreachable: the leader could not connect to a member's endpoint",
    ProgramFailed.exit_code: (
        "ProgramFailed: the program (kind command) exited non-zero or was killed; the "
        "message names the rank and its exit code or signal"
    ),
    EXIT_INTERRUPTED: (
        "stopped by SIGINT or SIGTERM (the member still leaves cleanly and says why)"
    ),
}


@dataclass
class WorkerOptions:
    job_id: str
    world_size: int
    etcd: str
    kind: str = "noop"
    namespace: str = "/coordinator"
    ttl: int = 10
    timeout: float = 300.0
    connect_timeout: float = 10.0
    advertise_address: str | None = None
    port: int = 0
    params: dict[str, str] = field(default_factory=dict)
    #: The `command` kind's program and its arguments, as a list (never split or joined).
    program: list[str] | None = None


#: Seconds a job gets, once the member knows the job cannot go on, to fail by itself
#: (with its own, better message) before the watchdog ends the process for it.
TROUBLE_GRACE_SECONDS = 5.0


class Watchdog:
    """Ends the process when the job cannot go on but its code does not return.

    A job may be inside native code that never looks at etcd (an XGBoost
    collective waiting on a dead peer, a tracker shutting down): the member
    then knows the job is lost, yet nothing would raise. After a grace the
    watchdog reports the failure as the main thread would have, and exits.
    """

    def __init__(self, member: Member, grace: float = TROUBLE_GRACE_SECONDS) -> None:
        self.member, self.grace = member, grace
        self._lock = threading.Lock()
        self._disarmed = False
        self._code: int | None = None  # the outcome the main thread already reported
        self._timer: threading.Timer | None = None

    def arm(self, error: RendezvousError) -> None:
        with self._lock:
            if self._disarmed or self._timer is not None:
                return
            self._timer = threading.Timer(self.grace, self._fire, args=(error,))
            self._timer.daemon = True
            self._timer.start()

    def report(self, outcome: Callable[[], int]) -> int:
        """Report the main thread's outcome (never alongside the watchdog's own report);
        firing later only exits with its code."""
        with self._lock:
            self._code = outcome()
            return self._code

    def disarm(self) -> None:
        """The main thread is done: the watchdog must not act."""
        with self._lock:
            self._disarmed = True
            if self._timer is not None:
                self._timer.cancel()

    def _fire(self, error: RendezvousError) -> None:
        with self._lock:
            if self._disarmed:
                return
            self._disarmed = True
            print(
                f"the job did not stop within {self.grace:g}s of the job's loss: "
                "the watchdog ends the process",
                file=sys.stderr,
            )
            code = self._code
            if code is None:
                code = _fail(error, error.exit_code, self.member)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


class Terminated(BaseException):
    """SIGTERM, turned into an exception so the member leaves cleanly and says why."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated("terminated by SIGTERM")


def run_worker(options: WorkerOptions) -> int:
    """Run one member through every phase; returns the process exit code."""
    if options.kind not in MEMBER_KINDS:
        print(
            f"error: unknown job kind {options.kind!r} (known: {', '.join(MEMBER_KINDS)})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:  # bad input is named before anything touches etcd
        check_name("job id", options.job_id)
        check_world_size(options.world_size)
        parse_endpoints(options.etcd)
        job = make_job(options.kind, options.params, options.world_size, options.program)
    except ValueError as exc:
        return _fail(exc, EXIT_USAGE)
    signal.signal(signal.SIGTERM, _on_sigterm)
    # `kill -USR1 <pid>` prints where each thread is to stderr: for a member that seems stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        etcd = Etcd(
            options.etcd,
            namespace=options.namespace,
            connect_timeout=options.connect_timeout,
            # etcd being away for less than the TTL loses nothing (no lease can expire
            # without a leader), so a call waits that long; past it, the session is lost
            # first and names the cause.
            retry_window=max(options.connect_timeout, options.ttl + TROUBLE_GRACE_SECONDS),
            probe=job_path(options.job_id),  # a member's etcd user may touch only its job
        )
    except EtcdError as exc:
        job.close()
        return _fail(exc, EXIT_ETCD_UNAVAILABLE, phase="etcd_connect")
    member: Member | None = None
    watchdog: Watchdog | None = None
    failure: tuple[BaseException, int] | None = None
    try:
        member = Member(
            etcd,
            options.job_id,
            options.world_size,
            ttl=options.ttl,
            timeout=options.timeout,
            address=options.advertise_address,
            port=options.port,
        )
        # A job that stops a program of its own gets that long more before the watchdog acts.
        watchdog = Watchdog(member, TROUBLE_GRACE_SECONDS + getattr(job, "stop_grace", 0.0))
        member.on_trouble(watchdog.arm)
        with member:
            member.leader_election()
            emit(Phase(phase="leader_election", rank=member.rank))
            roster = member.ip_exchange()
            emit(Phase(phase="ip_exchange", rank=member.rank))
            job.on_roster(member)
            member.connect()
            emit(Phase(phase="connect", rank=member.rank))
            member.phase = "training"  # the job runs until the `training` barrier
            result = job.run(member)
            member.barrier("training", timeout=getattr(job, "training_timeout", None))
            emit(Phase(phase="training", rank=member.rank))
            member.cleaner()
            emit(Phase(phase="cleaner", rank=member.rank, cleaned_up=member.cleaned_up))
        timeline = [TimelineEntry(**record.__dict__) for record in member.timeline]
        view = RosterView.model_validate(roster.model_dump(), strict=False)
        assert member.rank is not None
        emit(Done(rank=member.rank, roster=view, result=result, timeline=timeline))
    except RendezvousError as exc:
        failure = (exc, exc.exit_code)
    except EtcdUnavailable as exc:
        failure = (exc, EXIT_ETCD_UNAVAILABLE)
    except (KeyboardInterrupt, Terminated) as exc:
        failure = (exc, EXIT_INTERRUPTED)
    except ValueError as exc:  # a bad job parameter or argument
        failure = (exc, EXIT_USAGE)
    except Exception as exc:
        failure = (exc, EXIT_ERROR)
    if watchdog is None:
        code = _fail(*failure, member) if failure else EXIT_OK
    else:  # reported once: should closing hang, the watchdog only exits with this code
        code = watchdog.report(lambda: _fail(*failure, member) if failure else EXIT_OK)
    job.close()
    etcd.close()
    if watchdog is not None:
        watchdog.disarm()
    return code


def _fail(
    error: BaseException, code: int, member: Member | None = None, phase: str | None = None
) -> int:
    phase = phase or (member.phase if member else "init")
    rank = member.rank if member else None
    name = type(error).__name__
    message = str(error) or name
    who = "before taking a rank" if rank is None else f"rank {rank}"
    print(f"error [{name}] in phase '{phase}' ({who}): {message}", file=sys.stderr, flush=True)
    culprit = error.rank if isinstance(error, ProgramFailed) else None
    emit(
        Failed(
            phase=phase, rank=rank, error=name, message=message[:4000], exit_code=code,
            culprit=culprit,
        )
    )  # fmt: skip
    if member is not None and rank is not None and not isinstance(error, EtcdUnavailable):
        _record_failure(member, rank, phase, error, message)
    return code


def _record_failure(
    member: Member, rank: int, phase: str, error: BaseException, message: str
) -> None:
    """Leave the job's etcd state saying why this member failed (and whom it lost)."""
    record: dict[str, Any] = {"phase": phase, "error": type(error).__name__, "message": message}
    if isinstance(error, MemberLost):
        record["lost_rank"] = error.rank
    with contextlib.suppress(EtcdError):  # the record is a courtesy; the exit code is the fact
        member.etcd.put(member.keys.failure(rank), json.dumps(record))
