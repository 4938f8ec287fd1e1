"""What probes and scrapers ask a replica: alive (`/healthz`), ready (`/readyz`), metrics.

The two probes are open (a load balancer holds no token); the metrics need a reader's.
Neither probe waits on etcd for more than a second (`readiness`).
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.keys import Keys
from coordinator.service.rest.context import ApiContext, Context, reader
from coordinator.service.rest.readiness import Readiness

router = APIRouter()


def _readiness(context: ApiContext) -> Readiness:
    if context.readiness is None:
        context.readiness = Readiness(context.etcd, Keys(context.etcd.namespace).leader)
        context.closers.append(context.readiness.close)
    return context.readiness


@router.get("/healthz", responses={503: {}})
async def healthz(context: Context) -> JSONResponse:
    """Alive unless an etcd call is wedged past its deadline (a plain outage is not)."""
    stalled = _readiness(context).alive()
    if stalled is not None:
        return JSONResponse({"status": "stalled", "detail": stalled}, 503)
    return JSONResponse({"status": "ok"})


@router.get("/readyz", responses={503: {}})
async def readyz(context: Context) -> JSONResponse:
    """Ready when etcd answers a read within a second: a probe that waits out the
    client's whole retry window would leave a load balancer routing to us meanwhile."""
    reason = await _readiness(context).ready_async()
    if reason is not None:
        return JSONResponse({"status": "not ready", "detail": reason}, 503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", dependencies=reader, response_class=PlainTextResponse)
def metrics(context: Context) -> Response:
    return Response(generate_latest(context.metrics.registry), media_type=CONTENT_TYPE_LATEST)
