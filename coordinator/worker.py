"""One member's whole life as a process: the body of `coordinator worker`.

It reports progress as JSON lines on stdout (one per phase passed, then a
final `done` or `failed` line), so a launcher can follow N workers without
reading etcd, and a human can read container logs. The exit code says what
went wrong (see `EXIT_CODES`).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from coordinator.etcd.client import Etcd, EtcdError, EtcdUnavailable, parse_endpoints
from coordinator.events import emit
from coordinator.jobs import JOB_KINDS
from coordinator.rendezvous.errors import (
    JobFull,
    MemberLost,
    RendezvousError,
    RendezvousTimeout,
    SessionLost,
    Unreachable,
)
from coordinator.rendezvous.member import Member, check_name

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_ETCD_UNAVAILABLE = 3
EXIT_INTERRUPTED = 130

#: Exit code -> meaning; part of the CLI's interface (the README lists it).
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "the member passed every phase and cleaned up",
    EXIT_ERROR: "an unexpected error (message on stderr)",
    EXIT_USAGE: "bad arguments",
    EXIT_ETCD_UNAVAILABLE: "etcd could not be reached within the connect timeout",
    JobFull.exit_code: "the job already has all its members",
    MemberLost.exit_code: "another member died, lost etcd or failed",
    RendezvousTimeout.exit_code: "a phase passed its deadline; the message names who was missing",
    SessionLost.exit_code: "this member lost its own etcd lease and stopped",
    Unreachable.exit_code: "the leader could not connect to a member's endpoint",
    EXIT_INTERRUPTED: "stopped by SIGINT or SIGTERM",
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


class Terminated(BaseException):
    """SIGTERM, turned into an exception so the member leaves cleanly and says why."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated("terminated by SIGTERM")


def run_worker(options: WorkerOptions) -> int:
    """Run one member through every phase; returns the process exit code."""
    if options.kind not in JOB_KINDS:
        print(
            f"error: unknown job kind {options.kind!r} (known: {', '.join(JOB_KINDS)})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:  # bad input is named before anything touches etcd
        check_name("job id", options.job_id)
        parse_endpoints(options.etcd)
        job = JOB_KINDS[options.kind](options.params, options.world_size)
    except ValueError as exc:
        return _fail(exc, EXIT_USAGE)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        etcd = Etcd(
            options.etcd, namespace=options.namespace, connect_timeout=options.connect_timeout
        )
    except EtcdError as exc:
        job.close()
        return _fail(exc, EXIT_ETCD_UNAVAILABLE, phase="etcd_connect")
    member: Member | None = None
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
        with member:
            member.leader_election()
            emit("phase", phase="leader_election", rank=member.rank)
            roster = member.ip_exchange()
            emit("phase", phase="ip_exchange", rank=member.rank)
            job.on_roster(member)
            member.connect()
            emit("phase", phase="connect", rank=member.rank)
            member.phase = "training"  # the job runs until the `training` barrier
            result = job.run(member)
            member.barrier("training")
            emit("phase", phase="training", rank=member.rank)
            member.cleaner()
            emit("phase", phase="cleaner", rank=member.rank, cleaned_up=member.cleaned_up)
        timeline = [record.__dict__ for record in member.timeline]
        emit("done", rank=member.rank, roster=roster.model_dump(), result=result, timeline=timeline)
        return EXIT_OK
    except RendezvousError as exc:
        return _fail(exc, exc.exit_code, member)
    except EtcdUnavailable as exc:
        return _fail(exc, EXIT_ETCD_UNAVAILABLE, member)
    except (KeyboardInterrupt, Terminated) as exc:
        return _fail(exc, EXIT_INTERRUPTED, member)
    except ValueError as exc:  # a bad job parameter or argument
        return _fail(exc, EXIT_USAGE, member)
    except Exception as exc:
        return _fail(exc, EXIT_ERROR, member)
    finally:
        job.close()
        etcd.close()


def _fail(
    error: BaseException, code: int, member: Member | None = None, phase: str | None = None
) -> int:
    phase = phase or (member.phase if member else "init")
    rank = member.rank if member else None
    name = type(error).__name__
    message = str(error) or name
    print(
        f"error [{name}] in phase '{phase}' (rank {rank}): {message}", file=sys.stderr, flush=True
    )
    emit("failed", phase=phase, rank=rank, error=name, message=message, exit_code=code)
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
        member.etcd.put(f"{member.keys.job}failures/{rank:06d}", json.dumps(record))
