"""The REST client commands: submit, jobs, status, events, logs, cancel.

Exit codes mirror the job: 0 SUCCEEDED (or still live, for `status`), 1
FAILED, 130 CANCELLED; 2 a request the service refused (its message is
printed), 3 the service could not be reached.

The token: `--token`, else $COORDINATOR_TOKEN, else (for a service on this
host's loopback) the `api-token` file that `coordinator serve` made in its data
directory: $COORDINATOR_DATA, else ./coordinator-data (serve's own default).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn
from urllib.parse import urlsplit

import httpx
import typer
from httpx_sse import SSEError, connect_sse
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from coordinator.cli.members import member_kind
from coordinator.cli.options import (
    KindArgument,
    ParamOption,
    parse_env,
    parse_labels,
    parse_param_option,
    program_after_dashes,
    unset_option,
)
from coordinator.exit_codes import EXIT_ETCD_UNAVAILABLE

out = Console()
err = Console(stderr=True)

DEFAULT_SERVER = "http://127.0.0.1:8080"  # serve's default host and port
ServerOption = Annotated[str, typer.Option(envvar="COORDINATOR_SERVER", help="the service's URL")]
TokenOption = unset_option(
    str, "COORDINATOR_TOKEN", "bearer token [a local service's DATA_DIR/api-token]"
)
JobIdArgument = Annotated[str, typer.Argument(help="job id")]
OUTCOME_CODES = {"SUCCEEDED": 0, "FAILED": 1, "CANCELLED": 130}
RECONNECTS = 20  # an events stream that breaks is resumed this often before giving up


class Api:
    """Calls to one service; a refusal or an unreachable service ends the command."""

    def __init__(self, server: str, token: str | None) -> None:
        token = token or local_token(server)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=server, headers=headers, timeout=30.0)

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            err.print(f"[red]cannot reach {self.client.base_url}: {exc}[/red]")
            raise typer.Exit(EXIT_ETCD_UNAVAILABLE) from None
        if response.status_code >= 400:
            _refused(response)
        return response

    def events(self, job_id: str) -> Iterator[dict[str, Any]]:
        """The job's record at each change until its final state, resuming a broken stream
        after the last event seen (the service repeats nothing and loses nothing)."""
        last: str | None = None
        for attempt in range(RECONNECTS + 1):
            headers = {"Last-Event-ID": last} if last else {}
            try:
                with connect_sse(
                    self.client, "GET", f"/v1/jobs/{job_id}/events", headers=headers,
                    timeout=httpx.Timeout(30.0, read=60.0),
                ) as source:  # fmt: skip
                    if source.response.status_code >= 400:
                        source.response.read()
                        _refused(source.response)
                    for event in source.iter_sse():
                        last = event.id or last
                        if event.event == "deleted":
                            return
                        record = json.loads(event.data)
                        yield record
                        if record["state"] in OUTCOME_CODES:
                            return
                return
            except (httpx.TransportError, SSEError) as exc:
                if attempt == RECONNECTS:
                    err.print(f"[red]the events stream kept breaking: {exc}[/red]")
                    raise typer.Exit(EXIT_ETCD_UNAVAILABLE) from None
                time.sleep(min(0.2 * 2**attempt, 5.0))  # back off before resuming


def local_token(server: str) -> str | None:
    """The token of a service on this host's loopback, from the `api-token` its `serve`
    made (see the module docstring); None for another host or no such file."""
    from coordinator.rendezvous.address import is_loopback
    from coordinator.service.auth import find_token

    if not is_loopback(urlsplit(server).hostname or ""):
        return None
    folders = [Path(os.environ.get("COORDINATOR_DATA") or "coordinator-data")]
    try:
        return find_token(folders)
    except (OSError, ValueError) as exc:
        err.print(f"[red]{escape(str(exc))}[/red]")
        raise typer.Exit(2) from None


def _refused(response: httpx.Response) -> NoReturn:
    """Say why the service refused, and end the command: 2 for a refusal, 1 for its fault."""
    err.print(f"[red]{response.status_code}: {escape(_detail(response))}[/red]")
    raise typer.Exit(2 if response.status_code < 500 else 1)


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        return response.text
    if isinstance(detail, list):  # FastAPI's validation errors: name each field
        return "; ".join(
            f"{'.'.join(str(p) for p in item.get('loc', [])[1:])}: {item.get('msg')}"
            for item in detail
        )
    return str(detail)


def submit(
    ctx: typer.Context,
    kind: KindArgument = None,
    workers: Annotated[int, typer.Option(min=1, help="number of members")] = 2,
    param: ParamOption = None,
    job_id: Annotated[str | None, typer.Option("--id", help="job id [generated]")] = None,
    max_restarts: Annotated[int, typer.Option(min=0)] = 0,
    deadline: Annotated[float | None, typer.Option(help="seconds before it fails")] = None,
    priority: int = 0,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE (repeat)")] = None,
    launcher: Annotated[
        str | None, typer.Option(help="local, docker, agents or kubernetes [the service's]")
    ] = None,
    agent_selector: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE an agent must carry (repeat)")
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option(
            help="command jobs: NAME=VALUE, or NAME for this shell's value, in the program's "
            "environment (repeat)"
        ),
    ] = None,
    working_dir: Annotated[
        str | None,
        typer.Option(help="command jobs: the program's folder, under the service's root"),
    ] = None,
    wait: Annotated[bool, typer.Option(help="follow the job to its end")] = False,
    server: ServerOption = DEFAULT_SERVER,
    token: TokenOption = None,
) -> None:
    """Submit a job (safe to retry with the same --id).

    `coordinator submit --workers N -- PROGRAM [ARGS...]` submits your program as a
    `command` job (an exec token's right)."""
    program = program_after_dashes(ctx)
    kind_name = member_kind(kind.value if kind else None, program, default=None)
    spec: dict[str, Any] = {
        "kind": kind_name,
        "workers": workers,
        "params": parse_param_option(param),
        "max_restarts": max_restarts,
        "priority": priority,
        "labels": parse_labels(label),
        "agent_selector": parse_labels(agent_selector),
    }
    if program is not None:
        spec["command"] = program
    if env:
        spec["env"] = parse_env(env)
    if working_dir:
        spec["working_dir"] = working_dir
    if launcher:
        spec["launcher"] = launcher
    if job_id:
        spec["id"] = job_id
    if deadline is not None:
        spec["deadline_seconds"] = deadline
    api = Api(server, token)
    response = api.call("POST", "/v1/jobs", json=spec)
    record = response.json()
    existed = " (already submitted)" if response.status_code == 200 else ""
    out.print(f"{record['id']}: {record['state']}{existed}")
    if wait:
        raise typer.Exit(_follow(api, record["id"]))


def _follow(api: Api, job_id: str) -> int:
    """Show the job's progress until its final state; the exit code it mirrors."""
    state = "PENDING"
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[info]}")]  # fmt: skip
    with Progress(*columns, TimeElapsedColumn(), console=err) as progress:
        task = progress.add_task(job_id, total=None, info="")
        for record in api.events(job_id):
            state = record["state"]
            done = record.get("progress") or {}
            reason = record["conditions"][-1]["reason"] if record["conditions"] else ""
            metrics = "  ".join(
                f"{name} {value:.4g}"
                for name, value in (done.get("metrics") or {}).items()
                if isinstance(value, int | float) and not isinstance(value, bool)
            )
            progress.update(
                task,
                total=done.get("total"),
                completed=done.get("step") or 0,
                info=f"{state}: {metrics or reason}"[:50],  # the bar must fit 80 columns
            )
    out.print(f"{job_id}: {state}")
    return OUTCOME_CODES.get(state, 0)


def jobs(
    state: Annotated[str | None, typer.Option(help="only jobs in this state")] = None,
    kind: Annotated[str | None, typer.Option(help="only jobs of this kind")] = None,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE (repeat)")] = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many")] = 100,
    server: ServerOption = DEFAULT_SERVER,
    token: TokenOption = None,
) -> None:
    """List jobs, in id order."""
    api = Api(server, token)
    table = Table("id", "kind", "workers", "state", "since", "reason")
    token_: str | None = None
    shown = 0
    while shown < limit:
        params: dict[str, Any] = {"limit": min(500, limit - shown)}
        filters = {"state": state, "kind": kind, "page_token": token_}
        params |= {k: v for k, v in filters.items() if v}
        if label:
            params["label"] = label
        page = api.call("GET", "/v1/jobs", params=params).json()
        for record in page["jobs"]:
            last = record["conditions"][-1]
            since = time.strftime("%H:%M:%S", time.localtime(last["at"]))
            table.add_row(
                record["id"], record["spec"]["kind"], str(record["spec"]["workers"]),
                record["state"], since, last["reason"][:60],
            )  # fmt: skip
            shown += 1
        token_ = page.get("next_page_token")
        if not token_:
            break
    out.print(table)


def status(
    job_id: JobIdArgument, server: ServerOption = DEFAULT_SERVER, token: TokenOption = None
) -> None:
    """A job's state, history, members, progress and artifacts."""
    record = Api(server, token).call("GET", f"/v1/jobs/{job_id}").json()
    spec = record["spec"]
    out.print(f"[bold]{record['id']}[/bold]  {spec['kind']} x{spec['workers']}  {record['state']}")
    history = Table("state", "at", "reason", title="history")
    for condition in record["conditions"]:
        at = time.strftime("%H:%M:%S", time.localtime(condition["at"]))
        history.add_row(condition["state"], at, condition["reason"])
    out.print(history)
    if record["attempts"]:
        attempt = record["attempts"][-1]
        title = f"attempt {attempt['number']}"
        members = Table("rank", "address", "phase", "exit", "failure", title=title)
        for member in attempt["members"]:
            failure = member.get("failure") or {}
            members.add_row(
                str(member.get("rank", "")), member.get("address") or "", member["phase"],
                "" if member.get("exit_code") is None else str(member["exit_code"]),
                failure.get("message", "")[:80],
            )  # fmt: skip
        out.print(members)
    progress = record.get("progress") or {}
    if progress.get("step") is not None:
        done = f"{progress['step']}/{progress.get('total')}"
        out.print(f"progress: {done}  {progress.get('metrics')}")
    for name, path in (record.get("artifacts") or {}).items():
        out.print(f"{name}: {path}")
    raise typer.Exit(OUTCOME_CODES.get(record["state"], 0))


def events(
    job_id: JobIdArgument, server: ServerOption = DEFAULT_SERVER, token: TokenOption = None
) -> None:
    """Follow a job's changes (one line each) until its final state."""
    state = "PENDING"
    for record in Api(server, token).events(job_id):
        state = record["state"]
        last = record["conditions"][-1]
        progress = record.get("progress") or {}
        step = f" {progress['step']}/{progress.get('total')}" if progress.get("step") else ""
        out.print(f"{state}{step}  {last['reason']}")
    raise typer.Exit(OUTCOME_CODES.get(state, 0))


def logs(
    job_id: JobIdArgument,
    rank: Annotated[int | None, typer.Option(help="only this member")] = None,
    tail: Annotated[int | None, typer.Option(help="only the last N lines")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="until the members end")] = False,
    server: ServerOption = DEFAULT_SERVER,
    token: TokenOption = None,
) -> None:
    """The members' output, each line prefixed with its rank."""
    api = Api(server, token)
    params: dict[str, Any] = {"follow": follow}
    params |= {k: v for k, v in {"rank": rank, "tail": tail}.items() if v is not None}
    try:
        with api.client.stream(
            "GET", f"/v1/jobs/{job_id}/logs", params=params, timeout=httpx.Timeout(30.0, read=None)
        ) as response:
            if response.status_code >= 400:
                response.read()
                _refused(response)
            for text in response.iter_text():
                out.out(text, end="", highlight=False)
    except httpx.TransportError as exc:
        err.print(f"[red]cannot reach {server}: {exc}[/red]")
        raise typer.Exit(EXIT_ETCD_UNAVAILABLE) from None


def cancel(
    job_id: JobIdArgument, server: ServerOption = DEFAULT_SERVER, token: TokenOption = None
) -> None:
    """Cancel a job (idempotent); its members leave, then it is CANCELLED."""
    record = Api(server, token).call("POST", f"/v1/jobs/{job_id}/cancel").json()
    requested = " (cancel requested)" if record["state"] not in OUTCOME_CODES else ""
    out.print(f"{record['id']}: {record['state']}{requested}")
