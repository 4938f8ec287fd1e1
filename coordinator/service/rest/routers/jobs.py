"""The jobs' records: submit, list, read, cancel and delete jobs, and the kinds they may be.

Every handler reads or writes the job records in etcd (`store`), so any replica
answers for any job. Starting and stopping members is the leader's reconciler's
work; a cancel only marks the record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, Response
from pydantic import BaseModel

from coordinator.field_error import FieldError
from coordinator.jobs.kinds import KINDS, KindInfo
from coordinator.service.admission import admit
from coordinator.service.model import JobList, JobRecord, JobSpec, JobState
from coordinator.service.rest.context import (
    API,
    Context,
    invalid,
    may_exec,
    reader,
    stored_or_404,
    submitter,
)
from coordinator.service.store import JobConflict, JobNotFound

log = logging.getLogger(__name__)
router = APIRouter()


class KindList(BaseModel):
    kinds: list[KindInfo]


@router.post(
    f"{API}/jobs",
    dependencies=submitter,
    status_code=201,
    responses={
        200: {"model": JobRecord, "description": "the same job, submitted before"},
        400: {"description": "the body is not JSON"},
        409: {"description": "the id is taken by a job with another spec"},
    },
)
def submit(spec: JobSpec, request: Request, response: Response, context: Context) -> JobRecord:
    """Submit a job. Safe to retry: the same id with the same spec gives the same job
    (200); with another spec, 409. A `command` job (any program) needs an exec token."""
    if spec.kind in KINDS and KINDS[spec.kind].needs_exec and not may_exec(request):
        context.metrics.submissions.labels("invalid").inc()
        raise HTTPException(403, f"a {spec.kind} job runs any program: it needs the exec role")
    try:
        spec = admit(spec, context.policy())
    except FieldError as exc:
        context.metrics.submissions.labels("invalid").inc()
        raise invalid(exc.field.split("."), str(exc)) from None
    try:
        record, created = context.store.submit(spec, time.time())
    except JobConflict as exc:
        context.metrics.submissions.labels("conflict").inc()
        raise HTTPException(409, str(exc)) from None
    context.metrics.submissions.labels("created" if created else "existing").inc()
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"{API}/jobs/{record.id}"
    return record


@router.get(f"{API}/kinds", dependencies=reader)
def kinds() -> KindList:
    """The job kinds this service runs: parameters (types, defaults, help), members'
    roles by rank, the charts each has, and which need the exec role (a program)."""
    return KindList(kinds=[kind.describe() for kind in KINDS.values()])


@router.get(f"{API}/jobs", dependencies=reader)
def list_jobs(
    context: Context,
    state: JobState | None = None,
    kind: str | None = None,
    label: Annotated[list[str] | None, Query(description="key=value; all must match")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    page_token: str | None = None,
) -> JobList:
    wanted: dict[str, str] = {}
    for item in label or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise invalid(["label"], f"label {item!r}: expected key=value", where="query")
        wanted[key] = value

    def keep(record: JobRecord) -> bool:
        return (
            (state is None or record.state == state)
            and (kind is None or record.spec.kind == kind)
            and all(record.spec.labels.get(k) == v for k, v in wanted.items())
        )

    jobs, token = context.store.page(keep, limit, page_token)
    return JobList(jobs=jobs, next_page_token=token)


@router.get(
    f"{API}/jobs/{{job_id}}",
    dependencies=reader,
    response_model=JobRecord,
    responses={404: {}, 409: {"description": "the stored record is invalid"}},
)
async def get_job(job_id: str, context: Context) -> Response:
    """The job's record, as stored (from this replica's mirror of the records)."""
    store = context.store
    stored = store.cached(job_id) or await asyncio.to_thread(stored_or_404, store, job_id)
    return Response(stored.raw, media_type="application/json")


@router.post(
    f"{API}/jobs/{{job_id}}/cancel",
    dependencies=submitter,
    status_code=202,
    responses={404: {}},
)
def cancel(job_id: str, context: Context) -> JobRecord:
    """Cancel a job (idempotent): its members get SIGTERM, then SIGKILL after the
    service's grace, and it ends CANCELLED; a finished job stays as it is."""

    def mark(record: JobRecord) -> JobRecord | None:
        if record.state.terminal or record.cancel_requested_at is not None:
            return None
        return record.model_copy(update={"cancel_requested_at": time.time()})

    try:
        return context.store.update(job_id, mark)
    except JobNotFound:
        raise HTTPException(404, f"no job {job_id!r}") from None


@router.delete(
    f"{API}/jobs/{{job_id}}", dependencies=submitter, status_code=204, responses={404: {}}
)
def delete(job_id: str, context: Context) -> Response:
    """Forget a finished job: its record, every key it left, and its members' logs or
    containers (409 while it is live)."""
    stored = stored_or_404(context.store, job_id)
    if not stored.record.state.terminal:
        raise HTTPException(409, f"job {job_id!r} is {stored.record.state}; cancel it first")
    if not context.store.delete(stored):
        raise HTTPException(409, f"job {job_id!r} changed meanwhile; try again")
    launcher = context.launchers.get(stored.record.spec.launcher)
    if launcher is not None:  # its logs, or its stopped containers
        try:
            launcher.remove(stored.record.run_id)
        except ValueError as exc:  # names nothing of ours: nothing is removed
            log.warning("job %s: kept its members' files: %s", job_id, exc)
    return Response(status_code=204)
