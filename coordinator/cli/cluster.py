"""The commands around a deployment: `etcd` (local etcd), `exit-codes`, `k8s` (manifests)."""

from __future__ import annotations

import contextlib
import signal
from typing import Annotated

import typer

from coordinator.cli.options import JobKind, console
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.jobs.params import parse_params
from coordinator.worker import EXIT_CODES


def etcd_server() -> None:
    """Run an embedded etcd on a free loopback port until Ctrl-C (for trying `worker`).

    Its auth is on, and its client port wants its client certificate: connect as root
    with the settings it prints (the files are readable by you alone)."""
    with EmbeddedEtcd() as server:
        security = server.security
        console.print(f"etcd listening at [bold]{server.endpoint}[/bold]; Ctrl-C stops it")
        given = {"ca": security.ca, "cert": security.cert, "key": security.key,
                 "user": security.user, "password-file": security.password_file}  # fmt: skip
        options = " ".join(f"--etcd-{name} {value}" for name, value in given.items() if value)
        console.print(f"auth on: {options}", soft_wrap=True)
        print(server.endpoint, flush=True)
        # SIGTERM too stops it here, so its etcd (in a session of its own) goes with it.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


def exit_codes() -> None:
    """List the worker's exit codes and what each means."""
    for code, meaning in EXIT_CODES.items():
        print(f"{code:>4}  {meaning}")


def k8s_manifests(
    workers: Annotated[int, typer.Option(help="number of workers N (pods of the Indexed Job)")],
    job: Annotated[str, typer.Option(help="job id shared by the members")],
    image: Annotated[str, typer.Option(help="worker image")] = "etcd-coordinator:latest",
    etcd: Annotated[
        str | None,
        typer.Option(
            "--etcd",
            help="external etcd HOST:PORT[,...]; leaves the bundled etcd out [bundled]",
            show_default=False,
        ),
    ] = None,
    kind: Annotated[JobKind, typer.Option(help="job kind")] = "noop",  # type: ignore[assignment]
    namespace: Annotated[str, typer.Option(help="key prefix of this deployment")] = "/coordinator",
    param: Annotated[
        list[str] | None, typer.Option(help="job parameter KEY=VALUE (repeat, or comma-separate)")
    ] = None,
) -> None:
    """Print Kubernetes manifests for one job: `coordinator k8s ... | kubectl apply -f -`."""
    # Imported here: the manifests are only needed by this command.
    from coordinator.deploy import k8s as k8s_deploy

    try:
        pods = k8s_deploy.WorkerPods(
            workers=workers,
            job=job,
            image=image,
            etcd=etcd,
            namespace_prefix=namespace,
            kind=kind.value,
            params=",".join(f"{k}={v}" for k, v in parse_params(param or []).items()),
        )
        docs = k8s_deploy.render(pods)
    except k8s_deploy.InvalidValue as exc:
        raise typer.BadParameter(str(exc), param_hint=f"--{exc.field}") from None
    except ValueError as exc:  # a parameter that is not KEY=VALUE
        raise typer.BadParameter(str(exc), param_hint="--param") from None
    except FileNotFoundError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from None
    print(k8s_deploy.dump(docs), end="")
