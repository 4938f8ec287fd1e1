"""What the leader does next with a running job, decided from what it sees alone.

`decide` is pure: the job's record, its attempt's members as just observed and
the time in, the actions out. The reconciler applies them (`Reconciler._tend`):
so the rules of when a job succeeds, fails, restarts or is stopped can be read
and tested as a table, without processes or etcd.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.service.launchers import VANISHED
from coordinator.service.model import JobRecord, JobState, Member
from coordinator.service.states import restarts_left

S = JobState
#: The phases after which every member found the others: the job is RUNNING.
PAST_CONNECT = {"connect", "training", "cleaner", "done"}


@dataclass(frozen=True)
class Advance:
    """Move the job to `state` (RUNNING, or a final state between two attempts)."""

    state: JobState
    reason: str


@dataclass(frozen=True)
class StopAttempt:
    """Ask the attempt's members to leave; once they are gone the job enters `then`."""

    reason: str
    then: JobState


@dataclass(frozen=True)
class KillStragglers:
    """The grace after stopping passed: kill the members still running."""


@dataclass(frozen=True)
class FinishAttempt:
    """Every member of the stopping attempt is gone: clear its keys, enter its `then`."""


@dataclass(frozen=True)
class StartNext:
    """The last attempt ended and restarts allow another: start it."""


Action = Advance | StopAttempt | KillStragglers | FinishAttempt | StartNext


def decide(record: JobRecord, members: list[Member], now: float, grace: float) -> list[Action]:
    """The actions for an active job whose last attempt's members are `members`
    (as just observed; ignored once that attempt has ended). `grace`: seconds from
    asking members to leave to killing them."""
    attempt = record.attempt
    if attempt is None:
        return []
    if attempt.ended_at is not None:  # RESTARTING: the failed attempt's members are gone
        if record.cancel_requested_at is not None:
            return [Advance(S.CANCELLED, "cancelled by request")]
        if overdue(record, now):
            return [Advance(S.FAILED, deadline_passed(record))]
        return [StartNext()]
    codes = [m.exit_code for m in members]
    if attempt.stopping_since is not None:
        if all(code is not None for code in codes):
            return [FinishAttempt()]
        if now - attempt.stopping_since > grace:
            return [KillStragglers()]
        return []
    actions: list[Action] = []
    complete = len(members) == record.spec.workers
    if record.state == S.STARTING and complete and all(m.phase in PAST_CONNECT for m in members):
        # (said even when the job is already over: its history shows it ran)
        actions.append(Advance(S.RUNNING, "every member passed connect"))
    if record.cancel_requested_at is not None:
        actions.append(StopAttempt("cancelled by request", S.CANCELLED))
    elif overdue(record, now):
        actions.append(StopAttempt(deadline_passed(record), S.FAILED))
    elif complete and all(code == 0 for code in codes):
        actions.append(StopAttempt("every member exited 0", S.SUCCEEDED))
    elif any(code not in (None, 0) for code in codes):
        then = S.RESTARTING if restarts_left(record) > 0 else S.FAILED
        actions.append(StopAttempt(root_cause(members, record.id), then))
    return actions


def overdue(record: JobRecord, now: float) -> bool:
    """The job's deadline (counted from its first attempt's start) has passed."""
    if record.spec.deadline_seconds is None:
        return False
    first = record.attempts[0].started_at if record.attempts else now
    return now - first > record.spec.deadline_seconds


def deadline_passed(record: JobRecord) -> str:
    return f"deadline of {record.spec.deadline_seconds:g}s passed"


def root_cause(members: list[Member], job_id: str) -> str:
    """Why the attempt failed: a member's own failure before one that only lost a peer,
    and a member that died without a word named by its rank. A failed program is named
    by the rank whose program ended first (the failure's `culprit`), whichever member
    said it; the reason ends with the command that shows that rank's output."""
    failures = [m for m in members if m.failure is not None]
    own = [m for m in failures if m.failure and m.failure.get("error") != "MemberLost"]
    for member in own:
        return describe(member, job_id)
    for member in members:
        if member.exit_code not in (None, 0) and member.failure is None:
            return describe(member, job_id)
    return describe(failures[0], job_id) if failures else "a member failed"


def describe(member: Member, job_id: str) -> str:
    who = f"rank {member.rank}" if member.rank is not None else f"member {member.index}"
    shown = member.rank  # whose output tells more
    if member.failure is not None:
        error, message = member.failure.get("error"), member.failure.get("message")
        culprit = member.failure.get("culprit")
        if error == "ProgramFailed" and type(culprit) is int:  # "rank 1: the program ..."
            said, shown = str(message), culprit
        else:
            said = f"{who} failed ({error}): {message}"
    elif member.exit_code == VANISHED:
        said = f"{who} ended without a word (killed?)"
    elif (member.exit_code or 0) > 128:
        said = f"{who} was killed by signal {member.exit_code - 128} (exit {member.exit_code})"
    else:
        said = f"{who} exited {member.exit_code}"
    if shown is None:
        return said
    return f"{said}; its output: coordinator logs {job_id} --rank {shown}"
