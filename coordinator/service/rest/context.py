"""What every router of the API shares: the replica's context and the dependencies on it.

`create_app` leaves one `ApiContext` on the app; a route takes it as a `Context`
parameter. Who may call a route was decided by `Boundary` (the one place a bearer
token is parsed) before the body was read; the dependencies here only read its
verdict from the request's scope. The answers shared by the routers live here too:
a 422 naming the field, a 404 for an unknown job, a 409 for an invalid record.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request

from coordinator.etcd.client import Etcd
from coordinator.jobs.threads import host_cores
from coordinator.service.admission import Policy, Roots
from coordinator.service.images import ImagePolicy
from coordinator.service.launchers import WorkerLauncher
from coordinator.service.model import Launcher
from coordinator.service.rest.auth import Role, Tokens
from coordinator.service.rest.boundary import ROLE_KEY
from coordinator.service.rest.metrics import ServiceMetrics
from coordinator.service.rest.readiness import Readiness
from coordinator.service.rest.simulation import Runner
from coordinator.service.store import InvalidRecord, JobNotFound, JobStore, Stored

API = "/v1"


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
    simulator: Runner = field(default_factory=Runner)  # `POST /v1/simulate`'s processes
    max_threads: int = field(default_factory=host_cores)  # `serve --max-threads`: per member
    readiness: Readiness | None = None  # what the probes answer (None: made on first use)
    events_ping: float = 15.0  # seconds between keep-alives on a quiet events stream

    def policy(self) -> Policy:
        """What a submission may ask for here (`admission.admit`)."""
        assert self.roots is not None  # `create_app` leaves them set
        return Policy(
            launchers=self.launchers,
            max_workers=self.max_workers,
            roots=self.roots,
            max_threads=self.max_threads,
            default_launcher=self.default_launcher,
            local_gpus=len(self.local_gpus),
            images=self.images,
        )


async def _context(request: Request) -> ApiContext:
    """The app's context (async: a plain function would cost a thread hop per request)."""
    context: ApiContext = request.app.state.context
    return context


Context = Annotated[ApiContext, Depends(_context)]


def granted(request: Request) -> Role | None:
    """The role `Boundary` found the request's token to carry (None: no valid token)."""
    role: Role | None = request.scope.get(ROLE_KEY)
    return role


def _role(needed: Role) -> Callable[[Request], Awaitable[None]]:
    """A second look at what `Boundary` decided from the token, before the body was
    read: a route mounted outside its policy still refuses."""

    async def check(request: Request) -> None:
        role = granted(request)
        if role is None:
            raise HTTPException(
                401, "a valid bearer token is required", {"WWW-Authenticate": "Bearer"}
            )
        if not role.covers(needed):
            raise HTTPException(403, f"this token's role is {role}; this needs {needed}")

    return check


reader = [Depends(_role(Role.READ))]  # a route's `dependencies=`: it only looks
submitter = [Depends(_role(Role.SUBMIT))]  # it changes something


def may_exec(request: Request) -> bool:
    """Whether the request's token may run any program (a `command` job)."""
    role = granted(request)
    return role is not None and role.covers(Role.EXEC)


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


def stored_or_404(store: JobStore, job_id: str) -> Stored:
    """The job's stored record: 404 without one, 409 naming why when it fails validation."""
    try:
        return store.get(job_id)
    except JobNotFound:
        raise HTTPException(404, f"no job {job_id!r}") from None
    except InvalidRecord as exc:
        raise HTTPException(409, str(exc)) from None
