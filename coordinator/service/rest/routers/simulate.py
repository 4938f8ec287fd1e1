"""`POST /v1/simulate`: the step-barrier simulator, for the dashboard's simulator view.

A request is priced before it runs and refused (422, naming the fields) above its
step budget; an accepted one runs in a process of its own (`simulation.Runner`,
the context's `simulator`), never in the service's threads, which the other
endpoints need.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, HTTPException, Request, Response

from coordinator.barriers.arguments import barrier_list
from coordinator.service.model import Simulation, SimulationRequest
from coordinator.service.rest import simulation
from coordinator.service.rest.boundary import GONE_KEY
from coordinator.service.rest.context import API, Context, invalid, invalid_fields, submitter

router = APIRouter()


@router.post(
    f"{API}/simulate",
    dependencies=submitter,
    responses={
        400: {"description": "the body is not JSON"},
        422: {},
        429: {"description": "the simulator is busy: try again later"},
        503: {"description": "the service is stopping"},
        504: {"description": "the simulation took too long"},
    },
)
async def simulate(request: SimulationRequest, http: Request, context: Context) -> Simulation:
    """Run the simulator (no etcd, virtual workers) for each method asked for, in a
    process of its own; refused (422) above its step budget."""
    try:
        specs = barrier_list(request.barrier, None, None, None)
    except ValueError as exc:
        raise invalid(["barrier"], str(exc)) from None
    try:
        model = simulation.parse_api_delay(request.delay)
    except ValueError as exc:
        raise invalid(["delay"], str(exc)) from None
    try:
        simulation.check_affordable(request.workers, request.seconds, len(specs), model)
        result = await context.simulator.run(
            simulation.simulate_methods, request.model_dump(), _client_gone(http)
        )
    except simulation.Unaffordable as exc:
        raise invalid_fields(exc.fields, str(exc)) from None
    except simulation.Busy as exc:
        raise HTTPException(429, str(exc), {"Retry-After": "5"}) from None
    except simulation.TimedOut as exc:
        raise HTTPException(504, str(exc)) from None
    except simulation.Stopping as exc:
        raise HTTPException(503, str(exc), {"Retry-After": "5"}) from None
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
