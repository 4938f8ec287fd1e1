"""The `coordinator` typer app, with every command registered on it in help order."""

from __future__ import annotations

import os

import typer

from coordinator.cli import (
    agent,
    client,
    cluster,
    credentials,
    members,
    options,
    serve,
    simulate,
)

__all__ = ["app"]

app = typer.Typer(
    help="Containers that find each other through etcd and train together.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def private_files() -> None:
    """Everything a command writes (logs, artifacts, credentials, the etcd's data) is its
    user's alone: files 0600, folders 0700."""
    os.umask(0o077)


# Registered here, not by decorators in the modules, so the order in `--help` is explicit.
app.command(cls=options.ProgramCommand)(members.worker)
app.command(cls=options.ProgramCommand)(members.run)
app.command("etcd")(cluster.etcd_server)
app.command("exit-codes")(cluster.exit_codes)
app.command("k8s")(cluster.k8s_manifests)
app.command("simulate")(simulate.simulate_barriers)
app.command("serve")(serve.serve)
app.command("agent")(agent.agent)
app.add_typer(credentials.app, name="credentials")
app.command("submit", cls=options.ProgramCommand)(client.submit)
app.command("jobs")(client.jobs)
app.command("status")(client.status)
app.command("events")(client.events)
app.command("logs")(client.logs)
app.command("cancel")(client.cancel)
