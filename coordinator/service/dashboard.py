"""The dashboard: a page at `/` and the few endpoints only it needs.

The page (`coordinator/web/`: HTML, CSS and JS of our own, no build step and
nothing from a CDN) is served to anyone; everything it shows comes from the
API with the user's token, so the page itself holds no data.

- `GET /v1/whoami`: the token's role, so the page shows a reader no controls.
- `GET /v1/jobs/{id}/series`: the charts' history, from the members' events.
- `GET /v1/jobs/{id}/live`: Server-Sent Events while the job runs: trainers'
  step clocks from etcd (at most every `CLOCK_FLUSH_SECONDS`) and the members'
  new events (every `OUTPUT_POLL_SECONDS`).
- `POST /v1/simulate`: the simulator, for the page's simulator view.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Header, HTTPException, Request, Response
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse

from coordinator.etcd.client import WatchEvent
from coordinator.events import Done, Failed, MemberEvent, Metrics, Phase, Round, Step
from coordinator.jobs.kinds import KINDS
from coordinator.service import simulation
from coordinator.service.boundary import GONE_KEY
from coordinator.service.model import JobRecord, Member
from coordinator.service.series import Series, clock_bound, collect, live_clock, member_events

if TYPE_CHECKING:
    from coordinator.service.api import ApiContext

WEB = Path(__file__).resolve().parent.parent / "web"
CLOCK_FLUSH_SECONDS = 0.1
OUTPUT_POLL_SECONDS = 0.5
LIVE_EVENTS = (Round, Metrics, Step, Done, Failed, Phase)  # what the live charts follow


class WhoAmI(BaseModel):
    role: Literal["read", "submit", "exec", "none"]
    auth: bool  # whether the service asks for tokens at all


class SimulationRequest(BaseModel):
    """A simulator run: its size is priced before it starts (see `simulation`)."""

    barrier: Annotated[str, Field(max_length=200, description="methods, e.g. bsp,ssp:2,asp")] = (
        "bsp,ssp:2,asp"
    )
    workers: Annotated[int, Field(ge=1, le=10_000)] = 100
    seconds: Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)] = 100.0
    delay: Annotated[
        str,
        Field(
            max_length=200,
            description="exp:SHIFT,MEAN | gamma:SHAPE,SCALE | straggler:FRACTION,FACTOR[,BASE]"
            " (no trace: that reads a server file; `coordinator simulate` takes it)",
        ),
    ] = "exp:1,1"
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 0


class SimulatedMethod(BaseModel):
    label: str
    summary: dict[str, float | int | str]
    final_steps: list[int]  # sorted: the CDF's x values


class Simulation(BaseModel):
    methods: list[SimulatedMethod]


def add_dashboard(
    app: FastAPI, context: ApiContext, reader: list[Any], submitter: list[Any]
) -> None:
    app.mount("/ui", StaticFiles(directory=WEB), name="ui")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(WEB / "index.html")

    @app.get("/v1/whoami")
    async def whoami(authorization: Annotated[str | None, Header()] = None) -> WhoAmI:
        """The role of the bearer token presented: `none` for no valid token (the page
        then asks for one); anyone submits where the service has no tokens."""
        if context.tokens is None:
            return WhoAmI(role="exec", auth=False)
        scheme, _, token = (authorization or "").partition(" ")
        granted = context.tokens.role(token) if scheme.lower() == "bearer" else None
        return WhoAmI(role=granted.value if granted else "none", auth=True)

    @app.get("/v1/jobs/{job_id}/series", dependencies=reader, responses={404: {}})
    async def series(job_id: str) -> Series:
        """The history the charts draw: curves, trainers' clocks, staleness."""
        record = await asyncio.to_thread(_record, context, job_id)
        outputs = await asyncio.to_thread(_all_events, context, record)
        return collect(outputs, _barrier_params(record))

    @app.get(
        "/v1/jobs/{job_id}/live",
        dependencies=reader,
        responses={200: {"content": {"text/event-stream": {}}}, 404: {}},
        response_class=Response,
    )
    async def live(job_id: str) -> EventSourceResponse:
        """While the job lives: `bound` first (the method's clock bound), then `clocks`
        ({t, clocks: {rank: clock}}, from etcd) and `events` (the members' JSON events,
        from the first on); the stream ends once the job is final."""
        record = await asyncio.to_thread(_record, context, job_id)
        return EventSourceResponse(_live(context, record), ping=15)

    runner = simulation.Runner()
    context.closers.append(runner.close)

    @app.post(
        "/v1/simulate",
        dependencies=submitter,
        responses={
            400: {"description": "the body is not JSON"},
            422: {},
            429: {"description": "the simulator is busy: try again later"},
            504: {"description": "the simulation took too long"},
        },
    )
    async def simulate(request: SimulationRequest, http: Request) -> Simulation:
        """Run the simulator (no etcd, virtual workers) for each method asked for, in a
        process of its own; refused (422) above its step budget."""
        from coordinator.service.api import invalid, invalid_fields  # api imports this module
        from coordinator.simulator.spec import parse_barriers

        try:
            specs = parse_barriers(request.barrier, None, None, None)
        except ValueError as exc:
            raise invalid(["barrier"], str(exc)) from None
        try:
            model = simulation.parse_api_delay(request.delay)
        except ValueError as exc:
            raise invalid(["delay"], str(exc)) from None
        try:
            simulation.check_affordable(request.workers, request.seconds, len(specs), model)
            result = await runner.run(
                simulation.simulate_methods, request.model_dump(), _client_gone(http)
            )
        except simulation.Unaffordable as exc:
            raise invalid_fields(exc.fields, str(exc)) from None
        except simulation.Busy as exc:
            raise HTTPException(429, str(exc), {"Retry-After": "5"}) from None
        except simulation.TimedOut as exc:
            raise HTTPException(504, str(exc)) from None
        except simulation.Abandoned:
            return Response(status_code=499)  # type: ignore[return-value]  # nobody reads it
        except ValueError as exc:
            field = "delay" if "delay" in str(exc).lower() else "barrier"
            raise invalid([field], str(exc)) from None
        return Simulation.model_validate(result)


def _client_gone(request: Request) -> Callable[[], Awaitable[bool]]:
    """Whether the request's client has left (as `Boundary` saw it)."""
    gone = request.scope.get(GONE_KEY)

    async def check() -> bool:
        return gone.is_set() if gone is not None else await request.is_disconnected()

    return check


def _record(context: ApiContext, job_id: str) -> JobRecord:
    from coordinator.service.store import JobNotFound

    try:
        return context.store.get(job_id).record
    except JobNotFound:
        raise HTTPException(404, f"no job {job_id!r}") from None


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
    for member in _members(record):
        events += member_events(launcher.output(member, 0))
    return events


async def _live(context: ApiContext, record: JobRecord) -> AsyncIterator[dict[str, str]]:
    etcd = context.etcd
    prefix = etcd.key("jobs", record.id, "steps") + "/"
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
    offsets: dict[tuple[int, int], int] = {}
    launcher = context.launchers.get(record.spec.launcher)

    def new_events(current: JobRecord) -> list[dict[str, Any]]:
        found = []
        for attempt in current.attempts:
            for member in attempt.members:
                key = (attempt.number, member.index)
                chunk = launcher.output(member, offsets.get(key, 0)) if launcher else b""
                whole = chunk[: chunk.rfind(b"\n") + 1]
                offsets[key] = offsets.get(key, 0) + len(whole)
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
