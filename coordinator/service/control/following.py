"""What the leader learns from a job's members: their output, read as it grows.

Each member's JSON events (its stdout) give its rank, phase, failure and result,
and the job's progress (rounds or steps and the latest metrics), which is
written at most every `interval` seconds. What a member prints is not trusted
to fit the record: what would not is left out.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ValidationError

from coordinator.events import Done, Failed, Phase, Report, Round, Step
from coordinator.jobs.kinds import kind_of
from coordinator.service.control.output_reads import MemberKey, OutputReads
from coordinator.service.launchers import VANISHED, WorkerLauncher
from coordinator.service.model import JobRecord, Member
from coordinator.service.output_cursor import OutputCursor
from coordinator.service.series import member_events


class Follower:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._cursor: OutputCursor[MemberKey] = OutputCursor()  # (job, attempt, index)
        self._progress_at: dict[str, float] = {}
        self._pending_progress: dict[str, dict[str, Any]] = {}  # job -> not yet written
        self.reads = OutputReads()  # off the reconciler's thread: no agent holds it up

    def follow(
        self, record: JobRecord, attempt: int, member: Member, launcher: WorkerLauncher
    ) -> Member:
        """The member with what its new output and its exit code say. What a member
        prints is not trusted to fit the record: what would not is left out."""
        key = (record.id, attempt, member.index)
        offset = self._cursor.offset(key)
        chunk = self.reads.read(key, offset, lambda: launcher.output(member, offset))
        if chunk is None:  # its read is still running: its exit is looked at after it
            return member
        complete = self._cursor.advance(key, chunk)  # the rest: at the next tick
        update: dict[str, Any] = {}
        for event in member_events(complete):
            rank = getattr(event, "rank", None)
            if rank is not None and rank < record.spec.workers and rank != member.rank:
                update["rank"] = rank
                role = kind_of(record.spec.kind).role(record.spec.params, rank)
                update["role"] = _text(role, 100)
            if isinstance(event, Phase):
                update["phase"] = event.phase
            elif isinstance(event, Failed):
                update["failure"] = event.wire()
                update["phase"] = _text(f"failed in {event.phase}")
            elif isinstance(event, Done):
                update["phase"] = "done"
                if (address := event.address) is not None:
                    update["address"] = _text(address, 300)
                self._note_result(record, event.result)
            elif isinstance(event, Round | Step | Report):
                self._note_progress(record.id, event)
        if member.exit_code is None:
            code = launcher.exit_code(member)
            update["exit_code"] = code if code is None or _is_exit_code(code) else VANISHED
        return member.model_copy(update=fitting(member, update)) if update else member

    def _note_progress(self, job_id: str, event: Round | Step | Report) -> None:
        pending = self._pending_progress.setdefault(job_id, {})
        if isinstance(event, Round):  # xgboost: rounds and the evaluation metrics
            pending.update(step=event.round, total=event.rounds, metrics=event.metrics)
        elif isinstance(event, Step):  # steps and mnist trainers: steps and the loss
            pending.update(step=event.clock, total=event.target, metrics={"loss": event.loss})
        else:  # a command job's program, of itself: what it reports, no more
            reported = {"step": event.step, "total": event.total, "metrics": event.metrics}
            pending.update({k: v for k, v in reported.items() if v is not None and v != {}})

    def _note_result(self, record: JobRecord, result: dict[str, Any]) -> None:
        """The files the member's result names, as its kind declares them."""
        named = kind_of(record.spec.kind).artifacts
        found = {k: str(v) for k, v in result.items() if k in named and v}
        pending = self._pending_progress.setdefault(record.id, {})
        pending.setdefault("artifacts", {}).update(found)

    def progress(self, record: JobRecord) -> dict[str, Any] | None:
        """What to write about the job's progress now (None: nothing, or not yet)."""
        pending = self._pending_progress.get(record.id)
        if not pending:
            return None
        due = self._progress_at.get(record.id, 0.0) + self.interval
        if time.monotonic() < due and "artifacts" not in pending:
            return None
        self._progress_at[record.id] = time.monotonic()
        return self._pending_progress.pop(record.id)

    def forget(self, job_id: str, attempt: int, members: int, job_over: bool) -> None:
        """An attempt ended: its members' output is read no more (nor the job's, once over)."""
        self._cursor.forget(lambda key: key[:2] == (job_id, attempt))
        self.reads.forget(lambda key: key[:2] == (job_id, attempt))
        if job_over:
            self._pending_progress.pop(job_id, None)
            self._progress_at.pop(job_id, None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_exit_code(code: int) -> bool:
    return _is_int(code) and -1 <= code <= 255


def _text(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else str(value)
    return text[:limit]


def fitting(current: BaseModel, update: dict[str, Any]) -> dict[str, Any]:
    """`update` without the fields that would make `current` invalid (a member's output
    is not trusted to fit the record; the store refuses to write a record that fails)."""
    update = dict(update)
    while update:
        try:
            type(current).model_validate({**current.model_dump(), **update}, strict=True)
            return update
        except ValidationError as exc:
            bad = {error["loc"][0] for error in exc.errors() if error["loc"]} & update.keys()
            if not bad:
                return {}
            for name in bad:
                del update[name]
    return update
