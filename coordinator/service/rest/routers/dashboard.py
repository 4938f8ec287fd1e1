"""The dashboard: a page at `/` and the few endpoints only it needs.

The page (`coordinator/web/`: HTML, CSS and JS of our own, no build step and
nothing from a CDN) is served to anyone, its files under `/ui` (`WEB`, mounted by
`create_app`); everything it shows comes from the API with the user's token, so
the page itself holds no data. Its scripts are ES modules (app.js imports a module
per view), which a browser runs only when served as JavaScript: the static files'
`.js` type (tests/test_dashboard.py checks it).

- `GET /v1/whoami`: the token's role, so the page shows a reader no controls.
- `GET /v1/jobs/{id}/series`: the charts' history, from the members' events.
- `GET /v1/jobs/{id}/live`: Server-Sent Events while the job runs: trainers'
  step clocks from etcd (at most every `CLOCK_FLUSH_SECONDS`) and the members'
  new events (every `OUTPUT_POLL_SECONDS`).

The simulator's endpoint, which the page's simulator view calls, is `simulate`'s.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import FileResponse
from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse

from coordinator.etcd.watch import WatchEvent
from coordinator.events import Done, Failed, MemberEvent, Metrics, Phase, Round, Step
from coordinator.jobs.kinds import KINDS
from coordinator.keys import JobKeys
from coordinator.service.model import JobRecord, Member
from coordinator.service.output_cursor import OutputCursor
from coordinator.service.rest.context import (
    API,
    ApiContext,
    Context,
    granted,
    reader,
    stored_or_404,
)
from coordinator.service.series import Series, clock_bound, collect, live_clock, member_events

WEB = Path(__file__).resolve().parents[3] / "web"
CLOCK_FLUSH_SECONDS = 0.1
OUTPUT_POLL_SECONDS = 0.5
LIVE_EVENTS = (Round, Metrics, Step, Done, Failed, Phase)  # what the live charts follow

router = APIRouter()


class WhoAmI(BaseModel):
    role: Literal["read", "submit", "exec", "none"]
    auth: bool  # whether the service asks for tokens at all


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(WEB / "index.html")


@router.get(f"{API}/whoami")
async def whoami(
    request: Request,
    context: Context,
    # Documented, not read here: `Boundary` parsed it into the role before this runs.
    authorization: Annotated[str | None, Header()] = None,
) -> WhoAmI:
    """The role of the bearer token presented: `none` for no valid token (the page
    then asks for one); anyone submits where the service has no tokens."""
    role = granted(request)
    return WhoAmI(role=role.value if role else "none", auth=context.tokens is not None)


@router.get(f"{API}/jobs/{{job_id}}/series", dependencies=reader, responses={404: {}})
async def series(job_id: str, context: Context) -> Series:
    """The history the charts draw: curves, trainers' clocks, staleness."""
    record = await asyncio.to_thread(_record, context, job_id)
    outputs = await asyncio.to_thread(_all_events, context, record)
    return collect(outputs, _barrier_params(record))


@router.get(
    f"{API}/jobs/{{job_id}}/live",
    dependencies=reader,
    responses={200: {"content": {"text/event-stream": {}}}, 404: {}},
    response_class=Response,
)
async def live(job_id: str, context: Context) -> EventSourceResponse:
    """While the job lives: `bound` first (the method's clock bound), then `clocks`
    ({t, clocks: {rank: clock}}, from etcd) and `events` (the members' JSON events,
    from the first on); the stream ends once the job is final."""
    record = await asyncio.to_thread(_record, context, job_id)
    return EventSourceResponse(_live(context, record), ping=15)


def _record(context: ApiContext, job_id: str) -> JobRecord:
    return stored_or_404(context.store, job_id).record


def _barrier_params(record: JobRecord) -> dict[str, str]:
    """The parameters with the kind's default barrier method (a kind unknown here: as given)."""
    kind = KINDS.get(record.spec.kind)
    barrier = kind.barrier_params(record.spec.params) if kind is not None else None
    return barrier if barrier is not None else dict(record.spec.params)


def _members(record: JobRecord) -> list[Member]:
    return [m for attempt in record.attempts for m in attempt.members]


def _all_events(context: ApiContext, record: JobRecord) -> list[MemberEvent]:
    launcher = context.launchers.get(record.spec.launcher)
    if launcher is None:
        return []
    events = []
    cursor: OutputCursor[int] = OutputCursor()  # by place in `_members`
    for at, member in enumerate(_members(record)):
        events += member_events(cursor.read(at, partial(launcher.output, member)))
    return events


async def _live(context: ApiContext, record: JobRecord) -> AsyncIterator[dict[str, str]]:
    etcd = context.etcd
    prefix = JobKeys(etcd.namespace, record.id).steps
    latest: dict[int, int] = {}
    lock = threading.Lock()

    def note(key: str, value: bytes) -> None:
        if found := live_clock(key, value):
            with lock:
                latest[found[0]] = max(found[1], latest.get(found[0], -1))

    def on_clocks(events: list[WatchEvent]) -> None:
        for event in events:
            if event.kind == "put":
                note(event.key, event.value)

    kvs, revision = await asyncio.to_thread(etcd.get_prefix, prefix)
    for kv in kvs:
        note(kv.key, kv.value)
    watch = etcd.watch(prefix, on_clocks, start_revision=revision + 1, prefix=True)
    cursor: OutputCursor[tuple[int, int]] = OutputCursor()  # (attempt, index)
    launcher = context.launchers.get(record.spec.launcher)

    def new_events(current: JobRecord) -> list[dict[str, Any]]:
        found = []
        for attempt in current.attempts:
            for member in attempt.members:
                if launcher is None:
                    continue
                key = (attempt.number, member.index)
                whole = cursor.read(key, partial(launcher.output, member))
                found += [e.wire() for e in member_events(whole) if isinstance(e, LIVE_EVENTS)]
        return found

    try:
        bound = clock_bound(_barrier_params(record))
        yield {"event": "bound", "data": json.dumps({"bound": bound})}
        polled = 0.0
        while True:
            with lock:
                clocks, latest_copy = bool(latest), dict(latest)
                latest.clear()
            if clocks:
                data = {"t": time.time(), "clocks": latest_copy}
                yield {"event": "clocks", "data": json.dumps(data)}
            if time.monotonic() - polled >= OUTPUT_POLL_SECONDS:
                polled = time.monotonic()
                current = await asyncio.to_thread(_record, context, record.id)
                events = await asyncio.to_thread(new_events, current)
                if events:
                    yield {"event": "events", "data": json.dumps(events)}
                if current.state.terminal:
                    return
            await asyncio.sleep(CLOCK_FLUSH_SECONDS)
    finally:
        watch.cancel()
