"""What probes and scrapers ask a replica: alive (`/healthz`), ready (`/readyz`), metrics.

The two probes are open (a load balancer holds no token); the metrics need a reader's.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.etcd.errors import EtcdError
from coordinator.keys import Keys
from coordinator.service.context import Context, reader

READY_WINDOW = 1.0  # seconds /readyz retries etcd before it says 503

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {}})
def readyz(context: Context) -> JSONResponse:
    """Ready when etcd answers a read within a second: a probe that waits out the
    client's whole retry window would leave a load balancer routing to us meanwhile."""
    try:
        context.etcd.get(Keys(context.etcd.namespace).leader, window=READY_WINDOW)
    except EtcdError as exc:
        return JSONResponse({"status": "etcd unavailable", "detail": str(exc)}, 503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", dependencies=reader, response_class=PlainTextResponse)
def metrics(context: Context) -> Response:
    return Response(generate_latest(context.metrics.registry), media_type=CONTENT_TYPE_LATEST)
