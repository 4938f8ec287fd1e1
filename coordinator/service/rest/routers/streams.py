"""Following a job: its record's changes (Server-Sent Events) and its members' output.

Both stream for as long as the job lives, so both end on their own once it is final
(or deleted): a client that follows a job never has to guess when to stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Response
from fastapi.responses import PlainTextResponse, StreamingResponse
from sse_starlette.sse import EventSourceResponse

from coordinator.etcd.client import Etcd
from coordinator.etcd.watch import WatchEvent
from coordinator.events import member_own_line, neutralise, split_lines
from coordinator.jobs.kinds import kind_of
from coordinator.service.launchers import WorkerLauncher
from coordinator.service.model import JobRecord, Member
from coordinator.service.output_cursor import OutputCursor
from coordinator.service.rest.context import API, Context, reader, stored_or_404
from coordinator.service.store import InvalidRecord, JobNotFound, JobStore, Stored

FOLLOW_POLL_SECONDS = 0.25  # how often a followed log is read again (no file events)
MAX_REVISION = 2**63 - 2  # etcd's revisions are int64, and a watch starts one after

router = APIRouter()


def _job_stream(
    name: str, media_type: str, response_class: type[Response]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The route of a job's stream `name`: for readers, in `media_type`, 404 for no such job."""
    return router.get(
        f"{API}/jobs/{{job_id}}/{name}",
        dependencies=reader,
        responses={200: {"content": {media_type: {}}}, 404: {}},
        response_class=response_class,
    )


@_job_stream("events", "text/event-stream", Response)
async def events(
    job_id: str,
    context: Context,
    last_event_id: Annotated[int | None, Header(ge=0, le=MAX_REVISION)] = None,
) -> EventSourceResponse:
    """Server-Sent Events: the job's record at each change, `id` its etcd revision.
    Reconnecting with `Last-Event-ID` resumes after that revision: nothing lost, nothing
    repeated. The stream ends after the job's final state."""
    current = await asyncio.to_thread(stored_or_404, context.store, job_id)
    return EventSourceResponse(
        _record_changes(context.etcd, context.store, job_id, current, last_event_id),
        ping=context.events_ping,
    )


@_job_stream("logs", "text/plain", PlainTextResponse)
async def logs(
    job_id: str,
    context: Context,
    rank: Annotated[int | None, Query(ge=0)] = None,
    tail: Annotated[int | None, Query(ge=0)] = None,
    follow: bool = False,
    events: bool = False,
) -> StreamingResponse:
    """The members' output (stdout and stderr) of the latest attempt, each line prefixed
    with its member's rank; `follow` streams until every member has ended. A `command`
    job's shows its programs' lines, and the members' own events (JSON lines) too with
    `events`; other kinds' members are the program, and show everything."""
    record = (await asyncio.to_thread(stored_or_404, context.store, job_id)).record
    members = _chosen(record, rank)
    launcher = context.launchers.get(record.spec.launcher)
    if launcher is None:
        raise HTTPException(409, f"job {job_id!r} ran on {record.spec.launcher}, not here")
    everything = events or not kind_of(record.spec.kind).takes_command
    return StreamingResponse(
        _log_lines(context.store, launcher, record, members, tail, follow, everything),
        media_type="text/plain; charset=utf-8",
    )


async def _record_changes(
    etcd: Etcd, store: JobStore, job_id: str, current: Stored, last_seen: int | None
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
        store.keys.record(job_id),
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
                record = store.parse(job_id, change.value)
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
    events: bool,
) -> AsyncIterator[str]:
    cursor: OutputCursor[int] = OutputCursor()  # by member index

    def label(member: Member) -> str:
        return f"[rank {member.rank}] " if member.rank is not None else f"[member {member.index}] "

    def read() -> list[str]:
        lines = []
        for member in members:
            whole = cursor.read(member.index, partial(launcher.output, member))
            # Split as every reader splits; a member's own line keeps no hidden line end.
            text = [neutralise(line.decode(errors="replace")) for line in split_lines(whole)]
            if not events:
                text = [line for line in text if not member_own_line(line)]
            lines += [label(member) + line + "\n" for line in text]
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
