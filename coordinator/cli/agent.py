"""`coordinator agent`: run the members the service assigns to this host."""

from __future__ import annotations

import os
import signal
import socket
import threading
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from coordinator.cli.etcd_options import (
    DEFAULT_ETCD,
    EtcdOption,
    checked_security,
    connect,
    with_etcd_security,
)
from coordinator.cli.options import (
    MaxThreadsOption,
    MemberPidsLimitOption,
    NamespaceOption,
    RunAsOption,
    console,
    parse_labels,
    run_as_range,
)
from coordinator.etcd.security import EtcdSecurity
from coordinator.jobs.threads import MAX_THREADS_ENV, host_cores
from coordinator.keys import assignments_path
from coordinator.launch.pids import DEFAULT_PIDS_LIMIT


@with_etcd_security
def agent(
    etcd_settings: EtcdSecurity,  # the --etcd-* options, from `with_etcd_security`
    slots: Annotated[int, typer.Option(min=1, help="members this host runs at once")] = 2,
    agent_id: Annotated[
        str | None, typer.Option("--id", help="this agent's id, unique in the namespace [host]")
    ] = None,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE (repeat)")] = None,
    gpus: Annotated[
        str,
        typer.Option(
            help="GPU ids this host offers, e.g. 0,1,2,3: a member gets whole ones as "
            "CUDA_VISIBLE_DEVICES [none]",
            show_default=False,
        ),
    ] = "",
    service_key: Annotated[
        Path | None,
        typer.Option(
            envvar="COORDINATOR_SERVICE_KEY",
            help="the service's public key (PEM, its DATA_DIR/signing-key.pub): only "
            "assignments it signed run  [required]",
            show_default=False,
        ),
    ] = None,
    etcd: EtcdOption = None,
    namespace: NamespaceOption = "/coordinator",
    data_dir: Annotated[Path, typer.Option(help="members' output")] = Path("agent-data"),
    host: Annotated[
        str, typer.Option(envvar="COORDINATOR_HOST", help="address the output server listens on")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="port of the output server")] = 0,
    advertise: Annotated[
        str | None,
        typer.Option(
            envvar="COORDINATOR_ADVERTISE_ADDRESS",
            help="address the service reaches this agent at [--host; for 0.0.0.0, the "
            "address that routes to etcd]",
            show_default=False,
        ),
    ] = None,
    ttl: Annotated[
        int, typer.Option(min=2, help="lease TTL: a dead agent is noticed within it")
    ] = 10,
    drain_seconds: Annotated[
        float, typer.Option(min=0, help="on SIGTERM, how long members may finish before SIGTERM")
    ] = 30.0,
    max_threads: MaxThreadsOption = None,
    member_pids_limit: MemberPidsLimitOption = DEFAULT_PIDS_LIMIT,
    run_as: RunAsOption = None,
) -> None:
    """Register with etcd and run the members assigned to this agent; SIGTERM drains."""
    from coordinator.agent.daemon import Agent, AgentOptions
    from coordinator.agent.records import AgentTaken
    from coordinator.etcd.names import check_name
    from coordinator.launch import parse_gpus
    from coordinator.signing import load_public_key

    if service_key is None:
        raise typer.BadParameter(
            "required: the service's public key (its DATA_DIR/signing-key.pub), "
            "or COORDINATOR_SERVICE_KEY",
            param_hint="--service-key",
        )
    try:
        public_key = load_public_key(service_key)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--service-key") from None
    labels = parse_labels(label)
    try:
        gpu_ids = parse_gpus(gpus)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--gpus") from None
    try:
        agent_id = check_name("agent id", agent_id or socket.gethostname())
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--id") from None
    # The members check their jobs' thread counts against it (this host's cores without).
    os.environ[MAX_THREADS_ENV] = str(max_threads or host_cores())
    endpoints = etcd or DEFAULT_ETCD
    # Exported into the environment too: the members this agent starts inherit it.
    security = checked_security(endpoints, etcd_settings)
    options = AgentOptions(
        agent_id=agent_id,
        slots=slots,
        data_dir=data_dir.absolute(),
        service_key=public_key,
        labels=labels,
        host=host,
        port=port,
        advertise=advertise,
        ttl=ttl,
        drain_seconds=drain_seconds,
        gpus=gpu_ids,
        member_pids_limit=member_pids_limit,
        run_as=run_as_range(run_as),
    )
    # Its etcd user (`coordinator credentials agent`) may touch only its own keys.
    client = connect(endpoints, namespace, security, probe=assignments_path(agent_id))
    try:
        running = Agent(client, options)
    except AgentTaken as exc:
        console.print(f"[red]{exc}[/red]")
        client.close()
        raise typer.Exit(2) from None
    stop = threading.Event()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigterm)
    offered = f", GPUs {gpus}" if gpu_ids else ""
    console.print(f"agent {options.agent_id}: {slots} slots{offered}, output at {running.address}")
    try:
        running.run(stop)
    finally:
        client.close()
