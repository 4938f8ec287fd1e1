"""A Python client of the REST service: what `coordinator submit`, `jobs`, `status`,
`events`, `logs` and `cancel` are built on, for programs and notebooks.

    from coordinator.client import Client

    with Client() as service:  # a service on this host, its token found as the CLI finds it
        job = service.submit({"kind": "xgboost", "workers": 2, "params": {"rounds": "20"}})
        final = service.wait(job.id)
        print(final.state, final.conditions[-1].reason)

Results are the service's own models (`JobRecord`, `KindInfo`, `Simulation`), checked
as they arrive. Every failure is a `ServiceError` of one kind: `Refused` (bad input, its
`fields` named), `Unauthorized`, `NotFound`, `Conflict`, `Busy`, `Unreachable`,
`ServiceFailed`. The token: the one given, else $COORDINATOR_TOKEN, else (for a service
on this host's loopback) the `api-token` that `coordinator serve` made in
$COORDINATOR_DATA, else in ./coordinator-data.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
from httpx_sse import SSEError, connect_sse

from coordinator.service.model import (
    JobList,
    JobRecord,
    JobSpec,
    Simulation,
    SimulationRequest,
)

if TYPE_CHECKING:
    from coordinator.jobs.kinds import KindInfo

DEFAULT_SERVER = "http://127.0.0.1:8080"  # serve's default host and port
SERVER_ENV, TOKEN_ENV, DATA_ENV = "COORDINATOR_SERVER", "COORDINATOR_TOKEN", "COORDINATOR_DATA"
DEFAULT_DATA_DIR = "coordinator-data"  # serve's default --data-dir
RECONNECTS = 20  # a broken events stream is resumed this often before `Unreachable`


class ServiceError(Exception):
    """The service refused a call, failed it, or could not be reached. `status` is the
    HTTP status (None when no answer came), `detail` the service's own words."""

    def __init__(self, message: str, status: int | None = None, detail: Any = None) -> None:
        super().__init__(message)
        self.status, self.detail = status, detail


class Refused(ServiceError):
    """Bad input (400, 413, 422): `fields` maps each field named to what is wrong with it."""

    @property
    def fields(self) -> dict[str, str]:
        if not isinstance(self.detail, list):
            return {}
        return {_field(item): str(item.get("msg", "")) for item in self.detail}


class Unauthorized(ServiceError):
    """No valid token (401), or one whose role may not do this (403)."""


class NotFound(ServiceError):
    """No such job (404)."""


class Conflict(ServiceError):
    """The id is another job's, or the job is still live (409)."""


class Busy(ServiceError):
    """The service has no room for this now (429): try again later."""


class Unreachable(ServiceError):
    """No answer from the service (it is down, or the address is wrong)."""


class ServiceFailed(ServiceError):
    """The service failed the call (5xx): its fault, not the request's."""


class Client:
    """Calls to one service. `server`: its URL [$COORDINATOR_SERVER, else
    http://127.0.0.1:8080]; `token`: see the module's docstring."""

    def __init__(
        self, server: str | None = None, token: str | None = None, timeout: float = 30.0
    ) -> None:
        self.server = server or os.environ.get(SERVER_ENV) or DEFAULT_SERVER
        self.token_source = "given"
        if not token and os.environ.get(TOKEN_ENV):
            token, self.token_source = os.environ[TOKEN_ENV], f"${TOKEN_ENV}"
        if not token:
            token, self.token_source = local_token(self.server)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- jobs ------------------------------------------------------------------------

    def submit(self, spec: JobSpec | Mapping[str, Any]) -> JobRecord:
        """Submit a job; the same id and spec again return the same job (safe to retry)."""
        if isinstance(spec, JobSpec):
            spec = spec.model_dump(mode="json", exclude_unset=True)
        return self._record("POST", "/v1/jobs", json=dict(spec))

    def get(self, job_id: str) -> JobRecord:
        return self._record("GET", f"/v1/jobs/{job_id}")

    def jobs(
        self,
        state: str | None = None,
        kind: str | None = None,
        labels: Mapping[str, str] | None = None,
        page_size: int = 500,
    ) -> Iterator[JobRecord]:
        """Every job that matches, in id order, a page at a time."""
        page_token: str | None = None
        while True:
            params: dict[str, Any] = {"limit": page_size}
            filters = {"state": state, "kind": kind, "page_token": page_token}
            params |= {k: v for k, v in filters.items() if v}
            if labels:
                params["label"] = [f"{k}={v}" for k, v in labels.items()]
            page = JobList.model_validate_json(self._call("GET", "/v1/jobs", params=params).content)
            yield from page.jobs
            if not page.next_page_token:
                return
            page_token = page.next_page_token

    def cancel(self, job_id: str) -> JobRecord:
        """Ask for the job's end (idempotent); its members leave, then it is CANCELLED."""
        return self._record("POST", f"/v1/jobs/{job_id}/cancel")

    def delete(self, job_id: str) -> None:
        """Forget a finished job and its keys (`Conflict` while it is live)."""
        self._call("DELETE", f"/v1/jobs/{job_id}")

    # -- following ---------------------------------------------------------------------

    def events(self, job_id: str) -> Iterator[JobRecord]:
        """The job's record at each change, until its final state (or its deletion). A
        broken stream is resumed after the last change seen: nothing lost or repeated."""
        for record in self._changes(job_id):
            if record is not None:
                yield record

    def wait(self, job_id: str, timeout: float | None = None) -> JobRecord:
        """The job's record once it is final; `TimeoutError` after `timeout` seconds (the
        stream's keep-alives, every 15 s, are when it looks at the clock between changes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last = None
        for record in self._changes(job_id):
            last = record or last
            if last is not None and last.state.terminal:
                return last
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is not final after {timeout}s")
        return last or self.get(job_id)  # deleted meanwhile: NotFound

    def logs(
        self,
        job_id: str,
        rank: int | None = None,
        tail: int | None = None,
        follow: bool = False,
        events: bool = False,
    ) -> Iterator[str]:
        """The members' output, a line at a time, each prefixed `[rank r] `; `follow`:
        until the members end; `events`: a `command` job's members' own events too (its
        programs' lines alone otherwise)."""
        params: dict[str, Any] = {"follow": follow, "events": events}
        params |= {k: v for k, v in {"rank": rank, "tail": tail}.items() if v is not None}
        try:
            with self.http.stream(
                "GET", f"/v1/jobs/{job_id}/logs", params=params,
                timeout=httpx.Timeout(30.0, read=None),
            ) as response:  # fmt: skip
                if response.status_code >= 400:
                    response.read()
                    raise self._error(response)
                yield from response.iter_lines()
        except httpx.TransportError as exc:
            raise Unreachable(f"cannot reach {self.server}: {exc}") from None

    # -- the rest --------------------------------------------------------------------

    def kinds(self) -> list[KindInfo]:
        """The job kinds this service runs, with their parameters."""
        from coordinator.jobs.kinds import KindInfo  # (its module is slow to import)

        kinds = self._call("GET", "/v1/kinds").json()["kinds"]
        return [KindInfo.model_validate(kind) for kind in kinds]

    def simulate(self, request: SimulationRequest | Mapping[str, Any]) -> Simulation:
        """A run of the step-barrier simulator (`Busy` while others run)."""
        body = request if isinstance(request, Mapping) else request.model_dump(mode="json")
        answer = self._call("POST", "/v1/simulate", json=body, timeout=60.0)
        return Simulation.model_validate_json(answer.content)

    # -- internals -------------------------------------------------------------------

    def _record(self, method: str, path: str, **kwargs: Any) -> JobRecord:
        return JobRecord.model_validate_json(self._call(method, path, **kwargs).content)

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise Unreachable(_unreachable(self.server, exc)) from None
        if response.status_code >= 400:
            raise self._error(response)
        return response

    def _changes(self, job_id: str) -> Iterator[JobRecord | None]:
        """`events`, with None at each keep-alive (so a waiter can look at its clock)."""
        last_id: str | None = None
        for attempt in range(RECONNECTS + 1):
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                with connect_sse(
                    self.http, "GET", f"/v1/jobs/{job_id}/events", headers=headers,
                    timeout=httpx.Timeout(30.0, read=60.0),
                ) as source:  # fmt: skip
                    if source.response.status_code >= 400:
                        source.response.read()
                        raise self._error(source.response)
                    for event in source.iter_sse():
                        last_id = event.id or last_id
                        if event.event == "deleted":
                            return
                        if event.event != "job":  # a keep-alive (httpx-sse's empty event)
                            yield None
                            continue
                        record = JobRecord.model_validate_json(event.data)
                        yield record
                        if record.state.terminal:
                            return
                return
            except (httpx.TransportError, SSEError) as exc:
                if attempt == RECONNECTS:
                    broke = f"the events stream of {job_id} kept breaking: {exc}"
                    raise Unreachable(broke) from None
                time.sleep(min(0.2 * 2**attempt, 5.0))  # back off before resuming

    def _error(self, response: httpx.Response) -> ServiceError:
        detail = _detail(response)
        status = response.status_code
        message = f"{status}: {_describe(detail)}"
        if status == 401:
            message += f" (token: {self.token_source})"
        kind: type[ServiceError] = {
            401: Unauthorized, 403: Unauthorized, 404: NotFound, 409: Conflict, 429: Busy,
        }.get(status, ServiceFailed if status >= 500 else Refused)  # fmt: skip
        return kind(message, status, detail)


def local_token(server: str) -> tuple[str | None, str]:
    """The token of a service on this host's loopback, from the `api-token` its `serve`
    made, and where it came from (or where it was looked for); ValueError naming a file
    found but open to others or malformed."""
    from coordinator.rendezvous.address import is_loopback
    from coordinator.service.rest.auth import GENERATED_TOKEN_FILE, find_token

    if not is_loopback(urlsplit(server).hostname or ""):
        return None, f"none given, and {server} is not on this host: give one"
    folder = Path(os.environ.get(DATA_ENV) or DEFAULT_DATA_DIR)
    token = find_token([folder])
    where = folder.absolute() / GENERATED_TOKEN_FILE
    if token is None:
        return None, f"none given; none in ${TOKEN_ENV} or {where} (set ${DATA_ENV})"
    return token, str(where)


def _detail(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        return response.text
    return body.get("detail", body) if isinstance(body, dict) else body


def _describe(detail: Any) -> str:
    """The service's words: FastAPI's validation errors as `field: message; ...`."""
    if isinstance(detail, list):
        return "; ".join(f"{_field(item)}: {item.get('msg')}" for item in detail)
    return str(detail)


def _field(item: Any) -> str:
    loc = item.get("loc", []) if isinstance(item, dict) else []
    return ".".join(str(part) for part in loc[1:])  # without "body" or "query"


def _unreachable(server: str, exc: Exception) -> str:
    return (
        f"cannot reach the service at {server}: {exc}. Start it (`coordinator serve`), or "
        f"give its address (--server, ${SERVER_ENV})"
    )
