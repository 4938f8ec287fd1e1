"""The REST API, v1, assembled: the routers (`coordinator.service.rest.routers`) over one context.

This module only builds the app: it leaves the `ApiContext` where the routes'
`Context` dependency finds it, includes the routers, mounts the dashboard's files,
answers etcd's absence and invalid records, times every request, and puts
`Boundary` outermost, so a token is checked and a body capped before anything
else runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles

from coordinator.etcd.errors import EtcdError
from coordinator.service.admission import Roots
from coordinator.service.json_values import encodable
from coordinator.service.rest.boundary import Boundary, document_refusals
from coordinator.service.rest.context import ApiContext
from coordinator.service.rest.routers import dashboard, health, jobs, simulate, streams
from coordinator.service.store import InvalidRecord

ROUTERS = (jobs.router, streams.router, health.router, dashboard.router, simulate.router)


def create_app(context: ApiContext) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        context.simulator.close()  # simulations still running: killed
        for closer in context.closers:
            closer()

    app = FastAPI(
        title="etcd-coordinator",
        version="1",
        description="Distributed training jobs whose members rendezvous through etcd.",
        lifespan=lifespan,
    )
    if context.roots is None:
        context.roots = Roots.from_environment()
    app.state.context = context

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

    @app.exception_handler(RequestValidationError)
    async def refused(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422, whose echo of the input is always made encodable (a value JSON
        or UTF-8 cannot carry is escaped), so a refusal is never a 500."""
        return JSONResponse({"detail": encodable(exc.errors())}, 422)

    for router in ROUTERS:
        app.include_router(router)
    app.mount("/ui", StaticFiles(directory=dashboard.WEB), name="ui")  # routers cannot mount

    document_refusals(app)
    app.add_middleware(Boundary, tokens=context.tokens)  # outermost: before anything reads
    return app
