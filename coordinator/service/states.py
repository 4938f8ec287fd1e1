"""The job state machine: which transitions exist and why each happens.

Pure: `advance` returns a new record and never touches etcd. The store applies
it with a compare-and-swap, so two replicas never move one job twice.

- PENDING -> STARTING: the scheduler gave the job its slots; attempt 1 starts.
- PENDING -> CANCELLED: cancelled before it started.
- STARTING -> RUNNING: every member of the attempt passed `connect`.
- STARTING, RUNNING -> SUCCEEDED: every member exited 0.
- STARTING, RUNNING -> RESTARTING: a member failed and `max_restarts` allows
  another attempt.
- STARTING, RUNNING, RESTARTING -> FAILED: a member failed with no restart
  left, the deadline passed, or the members could not be started.
- STARTING, RUNNING, RESTARTING -> CANCELLED: cancelled; the members got
  SIGTERM, then SIGKILL after the grace.
- RESTARTING -> STARTING: the failed attempt's members are gone; the next
  attempt starts (a new rendezvous round).

SUCCEEDED, FAILED and CANCELLED are final.
"""

from __future__ import annotations

from coordinator.service.model import Condition, JobRecord, JobState

S = JobState
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.PENDING: frozenset({S.STARTING, S.CANCELLED}),
    S.STARTING: frozenset({S.RUNNING, S.SUCCEEDED, S.RESTARTING, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.RESTARTING, S.FAILED, S.CANCELLED}),
    S.RESTARTING: frozenset({S.STARTING, S.FAILED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    pass


def advance(record: JobRecord, state: JobState, reason: str, now: float) -> JobRecord:
    """The record in `state`, with the condition appended; raises on a transition that
    does not exist (a terminal state is final)."""
    if state not in TRANSITIONS[record.state]:
        raise IllegalTransition(f"job {record.id}: {record.state} -> {state} is not allowed")
    return record.model_copy(
        update={
            "state": state,
            "conditions": [*record.conditions, Condition(state=state, reason=reason, at=now)],
        }
    )


def restarts_left(record: JobRecord) -> int:
    """How many more attempts `max_restarts` allows after the current one."""
    return record.spec.max_restarts - max(0, len(record.attempts) - 1)
