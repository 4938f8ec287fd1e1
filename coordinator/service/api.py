"""The REST API, v1: submit, list, read, follow, cancel and delete jobs.

Every handler reads or writes the job records in etcd (`store`), so any
replica answers for any job. Starting and stopping members is the leader's
reconciler's work; a cancel only marks the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse

from coordinator.etcd.client import Etcd, EtcdError, WatchEvent
from coordinator.jobs import COMMAND
from coordinator.jobs.kinds import KINDS, KindInfo
from coordinator.service.admission import (
    Refused,
    Roots,
    admit_command,
    admit_gpus,
    admit_params,
    check_kind,
)
from coordinator.service.auth import Role, Tokens
from coordinator.service.boundary import ROLE_KEY, Boundary, document_refusals
from coordinator.service.dashboard import add_dashboard
from coordinator.service.images import ImagePolicy
from coordinator.service.launchers import OWN_SLOTS, WorkerLauncher
from coordinator.service.launchers.agents import AgentsLauncher
from coordinator.service.metrics import ServiceMetrics
from coordinator.service.model import JobList, JobRecord, JobSpec, JobState, Launcher, Member
from coordinator.service.store import InvalidRecord, JobConflict, JobNotFound, JobStore, Stored

log = logging.getLogger(__name__)
API = "/v1"
FOLLOW_POLL_SECONDS = 0.25  # how often a followed log is read again (no file events)
MAX_REVISION = 2**63 - 2  # etcd's revisions are int64, and a watch starts one after
READY_WINDOW = 1.0  # seconds /readyz retries etcd before it says 503


class KindList(BaseModel):
    kinds: list[KindInfo]


@dataclass
class ApiContext:
    etcd: Etcd
    store: JobStore
    launchers: dict[Launcher, WorkerLauncher]
    max_workers: int
    metrics: ServiceMetrics
    local_gpus: tuple[int, ...] = ()  # `serve --gpus`: what local members may get
    tokens: Tokens | None = None  # None: no auth (--insecure only)
    default_launcher: Launcher = Launcher.LOCAL  # for specs that name none
    roots: Roots | None = None  # where submitted paths may point (None: from the environment)
    # The images each container launcher may run a `command` job in (none: not enabled).
    images: dict[Launcher, ImagePolicy] = field(default_factory=dict)
    closers: list[Callable[[], None]] = field(default_factory=list)  # run when it stops


def invalid(field: list[str | int], message: str, where: str = "body") -> HTTPException:
    """A 422 in FastAPI's own shape, naming the field."""
    return invalid_fields([field], message, where)


def invalid_fields(fields: list[Any], message: str, where: str = "body") -> HTTPException:
    """A 422 naming each of several fields (a name, or a path as a list) with one message."""
    detail = [
        {
            "loc": [where, *(f if isinstance(f, list) else [f])],
            "msg": message,
            "type": "value_error",
        }
        for f in fields
    ]
    return HTTPException(status_code=422, detail=detail)


def create_app(context: ApiContext) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        for closer in context.closers:  # e.g. simulations still running: killed
            closer()

    app = FastAPI(
        title="etcd-coordinator",
        version="1",
        description="Distributed training jobs whose members rendezvous through etcd.",
        lifespan=lifespan,
    )
    store = context.store
    if context.roots is None:
        context.roots = Roots.from_environment()

    @app.middleware("http")
    async def timed(request: Request, call_next: Callable[[Request], Awaitable[Any]]) -> Any:
        began = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        context.metrics.requests.labels(request.method, path, str(response.status_code)).observe(
            time.perf_counter() - began
        )
        return response

    @app.exception_handler(EtcdError)
    async def etcd_down(request: Request, exc: EtcdError) -> JSONResponse:
        return JSONResponse({"detail": f"etcd is unavailable: {exc}"}, status_code=503)

    @app.exception_handler(InvalidRecord)
    async def invalid_record(request: Request, exc: InvalidRecord) -> JSONResponse:
        """A job whose stored record fails validation: named, never acted on (not a 500)."""
        return JSONResponse({"detail": str(exc)}, status_code=409)

    def role(needed: Role) -> Callable[..., Awaitable[None]]:
        """A second look at what `Boundary` decided from the token, before the body was
        read: a route mounted outside its policy still refuses."""

        async def check(request: Request) -> None:
            granted = request.scope.get(ROLE_KEY)
            if granted is None:
                raise HTTPException(
                    401, "a valid bearer token is required", {"WWW-Authenticate": "Bearer"}
                )
            if not granted.covers(needed):
                raise HTTPException(403, f"this token's role is {granted}; this needs {needed}")

        return check

    reader = [Depends(role(Role.READ))]
    submitter = [Depends(role(Role.SUBMIT))]

    # -- jobs -------------------------------------------------------------------

    @app.post(
        f"{API}/jobs",
        dependencies=submitter,
        status_code=201,
        responses={
            200: {"model": JobRecord, "description": "the same job, submitted before"},
            400: {"description": "the body is not JSON"},
            409: {"description": "the id is taken by a job with another spec"},
        },
    )
    def submit(spec: JobSpec, request: Request, response: Response) -> JobRecord:
        """Submit a job. Safe to retry: the same id with the same spec gives the same job
        (200); with another spec, 409. A `command` job (any program) needs an exec token."""
        granted = request.scope.get(ROLE_KEY)
        if spec.kind == COMMAND and not (granted is not None and granted.covers(Role.EXEC)):
            context.metrics.submissions.labels("invalid").inc()
            raise HTTPException(403, f"a {COMMAND} job runs any program: it needs the exec role")
        try:
            spec = check_spec(spec, context)
        except HTTPException:
            context.metrics.submissions.labels("invalid").inc()
            raise
        try:
            record, created = store.submit(spec, time.time())
        except JobConflict as exc:
            context.metrics.submissions.labels("conflict").inc()
            raise HTTPException(409, str(exc)) from None
        context.metrics.submissions.labels("created" if created else "existing").inc()
        response.status_code = 201 if created else 200
        response.headers["Location"] = f"{API}/jobs/{record.id}"
        return record

    @app.get(f"{API}/kinds", dependencies=reader)
    def kinds() -> KindList:
        """The job kinds this service runs: parameters (types, defaults, help), members'
        roles by rank, the charts each has, and which need the exec role (a program)."""
        return KindList(kinds=[kind.describe() for kind in KINDS.values()])

    @app.get(f"{API}/jobs", dependencies=reader)
    def list_jobs(
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

        jobs, token = store.page(keep, limit, page_token)
        return JobList(jobs=jobs, next_page_token=token)

    @app.get(
        f"{API}/jobs/{{job_id}}",
        dependencies=reader,
        response_model=JobRecord,
        responses={404: {}, 409: {"description": "the stored record is invalid"}},
    )
    async def get_job(job_id: str) -> Response:
        """The job's record, as stored (from this replica's mirror of the records)."""
        stored = store.cached(job_id) or await asyncio.to_thread(_stored_or_404, store, job_id)
        return Response(stored.raw, media_type="application/json")

    @app.post(
        f"{API}/jobs/{{job_id}}/cancel",
        dependencies=submitter,
        status_code=202,
        responses={404: {}},
    )
    def cancel(job_id: str) -> JobRecord:
        """Cancel a job (idempotent): its members get SIGTERM, then SIGKILL after the
        service's grace, and it ends CANCELLED; a finished job stays as it is."""

        def mark(record: JobRecord) -> JobRecord | None:
            if record.state.terminal or record.cancel_requested_at is not None:
                return None
            return record.model_copy(update={"cancel_requested_at": time.time()})

        try:
            return store.update(job_id, mark)
        except JobNotFound:
            raise HTTPException(404, f"no job {job_id!r}") from None

    @app.delete(
        f"{API}/jobs/{{job_id}}", dependencies=submitter, status_code=204, responses={404: {}}
    )
    def delete(job_id: str) -> Response:
        """Forget a finished job: its record, every key it left, and its members' logs or
        containers (409 while it is live)."""
        stored = _stored_or_404(store, job_id)
        if not stored.record.state.terminal:
            raise HTTPException(409, f"job {job_id!r} is {stored.record.state}; cancel it first")
        if not store.delete(stored):
            raise HTTPException(409, f"job {job_id!r} changed meanwhile; try again")
        context.etcd.delete_prefix(context.etcd.key("jobs", job_id) + "/")
        launcher = context.launchers.get(stored.record.spec.launcher)
        if launcher is not None:  # its logs, or its stopped containers
            try:
                launcher.remove(stored.record.run_id)
            except ValueError as exc:  # names nothing of ours: nothing is removed
                log.warning("job %s: kept its members' files: %s", job_id, exc)
        return Response(status_code=204)

    # -- following --------------------------------------------------------------

    @app.get(
        f"{API}/jobs/{{job_id}}/events",
        dependencies=reader,
        responses={200: {"content": {"text/event-stream": {}}}, 404: {}},
        response_class=Response,
    )
    async def events(
        job_id: str,
        last_event_id: Annotated[int | None, Header(ge=0, le=MAX_REVISION)] = None,
    ) -> EventSourceResponse:
        """Server-Sent Events: the job's record at each change, `id` its etcd revision.
        Reconnecting with `Last-Event-ID` resumes after that revision: nothing lost, nothing
        repeated. The stream ends after the job's final state."""
        current = await asyncio.to_thread(_stored_or_404, store, job_id)
        return EventSourceResponse(
            _record_changes(context.etcd, store, job_id, current, last_event_id),
            ping=15,
        )

    @app.get(
        f"{API}/jobs/{{job_id}}/logs",
        dependencies=reader,
        responses={200: {"content": {"text/plain": {}}}, 404: {}},
        response_class=PlainTextResponse,
    )
    async def logs(
        job_id: str,
        rank: Annotated[int | None, Query(ge=0)] = None,
        tail: Annotated[int | None, Query(ge=0)] = None,
        follow: bool = False,
    ) -> StreamingResponse:
        """The members' output (stdout and stderr) of the latest attempt, each line prefixed
        with its member's rank; `follow` streams until every member has ended."""
        record = (await asyncio.to_thread(_stored_or_404, store, job_id)).record
        members = _chosen(record, rank)
        launcher = context.launchers.get(record.spec.launcher)
        if launcher is None:
            raise HTTPException(409, f"job {job_id!r} ran on {record.spec.launcher}, not here")
        return StreamingResponse(
            _log_lines(store, launcher, record, members, tail, follow),
            media_type="text/plain; charset=utf-8",
        )

    # -- health -------------------------------------------------------------------

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {}})
    def readyz() -> JSONResponse:
        """Ready when etcd answers a read within a second: a probe that waits out the
        client's whole retry window would leave a load balancer routing to us meanwhile."""
        try:
            context.etcd.get(context.etcd.key("api", "leader"), window=READY_WINDOW)
        except EtcdError as exc:
            return JSONResponse({"status": "etcd unavailable", "detail": str(exc)}, 503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", dependencies=reader, response_class=PlainTextResponse)
    def metrics() -> Response:
        return Response(generate_latest(context.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_dashboard(app, context, reader, submitter)

    document_refusals(app)
    app.add_middleware(Boundary, tokens=context.tokens)  # outermost: before anything reads
    return app


def check_spec(spec: JobSpec, context: ApiContext) -> JobSpec:
    """The spec with its id, or a 422 naming the field: the kind's own parameter checks
    run here, so a bad job is refused before anything starts."""
    if spec.kind not in KINDS:
        known = ", ".join(KINDS)
        raise invalid(["kind"], f"unknown job kind {spec.kind!r} (known: {known})")
    if "launcher" not in spec.model_fields_set:
        spec = spec.model_copy(update={"launcher": context.default_launcher})
    launcher = context.launchers.get(spec.launcher)
    if launcher is None:
        known = ", ".join(context.launchers)
        raise invalid(["launcher"], f"launcher {spec.launcher} is not enabled here ({known})")
    if spec.launcher in OWN_SLOTS and spec.workers > context.max_workers:
        raise invalid(
            ["workers"],
            f"{spec.workers} workers can never fit: the service has {context.max_workers} slots",
        )
    try:
        admit_gpus(spec, len(context.local_gpus))
    except Refused as exc:
        raise invalid([exc.field], str(exc)) from None
    if isinstance(launcher, AgentsLauncher) and (why := launcher.never_fits(spec)):
        raise invalid(["gpus_per_worker" if spec.gpus_per_worker else "workers"], why)
    assert context.roots is not None
    try:
        spec = admit_command(spec, context.roots, context.images.get(spec.launcher))
    except Refused as exc:
        raise invalid(exc.field.split("."), str(exc)) from None
    try:
        params = admit_params(spec.kind, spec.params, context.roots)
    except Refused as exc:
        raise invalid(exc.field.split("."), str(exc)) from None
    if params != spec.params:
        spec = spec.model_copy(update={"params": params})
    try:
        check_kind(spec.kind, spec.params, spec.workers)
    except ValueError as exc:
        raise invalid(["params"], str(exc)) from None
    if not spec.id:
        spec = spec.model_copy(update={"id": f"{spec.kind}-{uuid.uuid4().hex[:10]}"})
    return spec


def _stored_or_404(store: JobStore, job_id: str) -> Stored:
    """The job's stored record: 404 without one, 409 naming why when it fails validation."""
    try:
        return store.get(job_id)
    except JobNotFound:
        raise HTTPException(404, f"no job {job_id!r}") from None
    except InvalidRecord as exc:
        raise HTTPException(409, str(exc)) from None


async def _record_changes(
    etcd: Etcd, store: JobStore, job_id: str, current: Any, last_seen: int | None
) -> AsyncIterator[dict[str, str]]:
    """The record's versions after revision `last_seen` (or the current one first), from an
    etcd watch, as SSE events; ends after a final state or the record's deletion."""
    if last_seen is None:
        yield _event(current.record, current.mod_revision)
        if current.record.state.terminal:
            return
        last_seen = current.mod_revision
    elif last_seen >= current.mod_revision and current.record.state.terminal:
        return  # nothing after what the client has, and nothing will come
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[list[WatchEvent]] = asyncio.Queue()
    watch = etcd.watch(
        store.key(job_id),
        lambda events: loop.call_soon_threadsafe(queue.put_nowait, events),
        start_revision=last_seen + 1,
        prev_kv=False,
    )
    try:
        while True:
            for change in await queue.get():
                if change.kind == "delete":
                    yield {"event": "deleted", "id": str(change.revision), "data": job_id}
                    return
                record = JobRecord.model_validate_json(change.value)
                yield _event(record, change.revision)
                if record.state.terminal:
                    return
    finally:
        watch.cancel()


def _event(record: JobRecord, revision: int) -> dict[str, str]:
    return {"event": "job", "id": str(revision), "data": record.model_dump_json()}


def _chosen(record: JobRecord, rank: int | None) -> list[Member]:
    attempt = record.attempt
    members = attempt.members if attempt else []
    if rank is None:
        return members
    chosen = [m for m in members if m.rank == rank]
    if not chosen:
        raise HTTPException(404, f"job {record.id!r} has no member with rank {rank} (yet)")
    return chosen


async def _log_lines(
    store: JobStore,
    launcher: WorkerLauncher,
    record: JobRecord,
    members: list[Member],
    tail: int | None,
    follow: bool,
) -> AsyncIterator[str]:
    offsets = {m.index: 0 for m in members}

    def label(member: Member) -> str:
        return f"[rank {member.rank}] " if member.rank is not None else f"[member {member.index}] "

    def read() -> list[str]:
        lines = []
        for member in members:
            chunk = launcher.output(member, offsets[member.index])
            whole = chunk[: chunk.rfind(b"\n") + 1]
            offsets[member.index] += len(whole)
            text = whole.decode(errors="replace")
            lines += [label(member) + line + "\n" for line in text.splitlines()]
        return lines

    first = await asyncio.to_thread(read)
    for line in first[-tail:] if tail is not None else first:
        yield line
    attempt = record.attempt.number if record.attempt else 0
    while follow:
        try:
            current = (await asyncio.to_thread(store.get, record.id)).record
        except (JobNotFound, InvalidRecord):
            return  # deleted, or no longer a record to follow: the stream ends
        ended = (
            current.attempt is None
            or current.attempt.number != attempt
            or current.attempt.ended_at is not None
            or current.state.terminal
        )
        for line in await asyncio.to_thread(read):
            yield line
        if ended:
            return
        await asyncio.sleep(FOLLOW_POLL_SECONDS)
