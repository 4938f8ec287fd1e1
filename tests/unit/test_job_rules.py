"""The reconciler's rules as a table: a job's record and its members in, the actions out.
Pure: no etcd, no processes."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.service.control.job_rules import (
    Action,
    Advance,
    FinishAttempt,
    KillStragglers,
    StartNext,
    StopAttempt,
    decide,
)
from coordinator.service.launchers import VANISHED
from coordinator.service.model import Attempt, JobRecord, JobSpec, JobState, Member

S = JobState
NOW = 1_000.0
GRACE = 10.0
LOST = {"error": "MemberLost", "message": "member rank 1 was lost during phase 'training'"}
OWN = {"error": "ValueError", "message": "bad learning rate"}
#: What a member whose program failed says: the rank whose program ended first, first.
PROGRAM = {
    "error": "ProgramFailed",
    "culprit": 1,
    "message": "rank 1: the program exited with code 1 (RuntimeError: boom); "
    "then rank 0's program exited with code 1",
}
LOGS = "; its output: coordinator logs job --rank {}"


def member(index: int, phase: str = "training", code: int | None = None, **extra: Any) -> Member:
    return Member(index=index, rank=index, phase=phase, exit_code=code, **extra)


def record(
    members: list[Member],
    *,
    state: JobState = S.RUNNING,
    workers: int = 2,
    attempts: int = 1,
    max_restarts: int = 0,
    deadline: float | None = None,
    started_at: float = NOW - 5,
    cancel: bool = False,
    stopping_since: float | None = None,
    ended: bool = False,
) -> JobRecord:
    spec = JobSpec(
        id="job", kind="noop", workers=workers, max_restarts=max_restarts, deadline_seconds=deadline
    )
    history = [
        Attempt(number=n, started_at=started_at, ended_at=started_at + 1, outcome="failed")
        for n in range(1, attempts)
    ]
    last = Attempt(
        number=attempts,
        started_at=started_at,
        members=members,
        stopping_since=stopping_since,
        then=S.FAILED if stopping_since is not None else None,
        ended_at=NOW - 1 if ended else None,
    )
    return JobRecord(
        id="job",
        uid="0" * 32,
        spec=spec,
        state=state,
        conditions=[],
        attempts=[*history, last],
        submitted_at=started_at,
        cancel_requested_at=NOW - 1 if cancel else None,
    )


CASES: list[tuple[str, JobRecord, list[Action]]] = [
    ("still training", record([member(0), member(1)]), []),
    (
        "every member past connect: RUNNING",
        record([member(0, "connect"), member(1, "training")], state=S.STARTING),
        [Advance(S.RUNNING, "every member passed connect")],
    ),
    (
        "not every member started yet: still STARTING",
        record([member(0, "training")], state=S.STARTING),
        [],
    ),
    (
        "all exit 0: success",
        record([member(0, "done", 0), member(1, "done", 0)]),
        [StopAttempt("every member exited 0", S.SUCCEEDED)],
    ),
    (
        "a member's own failure is the reason, not the peer that lost it",
        record([member(0, code=5, failure=LOST), member(1, code=1, failure=OWN)]),
        [StopAttempt("rank 1 failed (ValueError): bad learning rate" + LOGS.format(1), S.FAILED)],
    ),
    (
        "a failed program is named by the rank whose program failed first, whoever said it",
        record([member(0, code=9, failure=PROGRAM), member(1, code=1, failure=LOST)]),
        [StopAttempt(PROGRAM["message"] + LOGS.format(1), S.FAILED)],
    ),
    (
        "a member killed without a word is named by its rank",
        record([member(0, code=5, failure=LOST), member(1, code=137)]),
        [StopAttempt("rank 1 was killed by signal 9 (exit 137)" + LOGS.format(1), S.FAILED)],
    ),
    (
        "a member that vanished",
        record([member(0), member(1, code=VANISHED)]),
        [StopAttempt("rank 1 ended without a word (killed?)" + LOGS.format(1), S.FAILED)],
    ),
    (
        "a failure with restarts left: RESTARTING",
        record([member(0, code=1, failure=OWN), member(1)], max_restarts=1),
        [
            StopAttempt(
                "rank 0 failed (ValueError): bad learning rate" + LOGS.format(0), S.RESTARTING
            )
        ],
    ),
    (
        "a failure with the restarts used up: FAILED",
        record([member(0, code=1, failure=OWN), member(1)], max_restarts=1, attempts=2),
        [StopAttempt("rank 0 failed (ValueError): bad learning rate" + LOGS.format(0), S.FAILED)],
    ),
    (
        "the deadline passed",
        record([member(0), member(1)], deadline=3),
        [StopAttempt("deadline of 3s passed", S.FAILED)],
    ),
    (
        "a cancel wins over a failure",
        record([member(0, code=1, failure=OWN), member(1)], cancel=True),
        [StopAttempt("cancelled by request", S.CANCELLED)],
    ),
    (
        "cancelled during start, once every member passed connect",
        record([member(0, "connect"), member(1, "connect")], state=S.STARTING, cancel=True),
        [
            Advance(S.RUNNING, "every member passed connect"),
            StopAttempt("cancelled by request", S.CANCELLED),
        ],
    ),
    (
        "stopping: waits for the members within the grace",
        record([member(0, code=0), member(1)], stopping_since=NOW - GRACE + 1),
        [],
    ),
    (
        "stopping: the grace passed",
        record([member(0, code=0), member(1)], stopping_since=NOW - GRACE - 1),
        [KillStragglers()],
    ),
    (
        "stopping: every member gone",
        record([member(0, code=0), member(1, code=143)], stopping_since=NOW - 1),
        [FinishAttempt()],
    ),
    (
        "between attempts: the next one",
        record([], state=S.RESTARTING, ended=True, max_restarts=1),
        [StartNext()],
    ),
    (
        "between attempts: cancelled",
        record([], state=S.RESTARTING, ended=True, max_restarts=1, cancel=True),
        [Advance(S.CANCELLED, "cancelled by request")],
    ),
    (
        "between attempts: the deadline passed",
        record([], state=S.RESTARTING, ended=True, max_restarts=1, deadline=3),
        [Advance(S.FAILED, "deadline of 3s passed")],
    ),
]


@pytest.mark.parametrize(("case", "job", "expected"), CASES, ids=[c[0] for c in CASES])
def test_decide(case: str, job: JobRecord, expected: list[Action]) -> None:
    assert job.attempt is not None
    assert decide(job, job.attempt.members, NOW, GRACE) == expected
