"""`coordinator credentials`: etcd users of least privilege, made by an operator as root.

An agent's user may touch its registration, its assignments and its reports, read
the placements' commits, and nothing of any job or other agent (`agent_grants`; run
`agent` again for an older user: it adds what the agent may now need). A job's user
may touch its job's keys only (`job_grants`): for members started by hand
(`coordinator worker`, the one-job Kubernetes and compose files); the service and
`coordinator run` make their jobs' users themselves. Root's
settings come from the data dir of a `coordinator serve` with its own etcd
(`--data-dir`), or from the `--etcd-*` options.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from coordinator.cli.etcd_options import (
    DEFAULT_ETCD,
    EtcdOption,
    checked_security,
    connect,
    with_etcd_security,
)
from coordinator.cli.options import NamespaceOption, console, unset_option
from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.users import (
    CannotManageUsers,
    provision_agent,
    provision_job,
    revoke_agent,
    revoke_job,
    write_password_file,
)
from coordinator.exit_codes import EXIT_ETCD_UNAVAILABLE

app = typer.Typer(
    help="etcd users of least privilege (for agents, or a job's members started by hand), "
    "made with etcd's root user; API tokens.",
    no_args_is_help=True,
)

AgentId = Annotated[str, typer.Argument(help="the agent's id (its --id)")]
DataDirOption = unset_option(
    Path,
    "COORDINATOR_DATA",
    "data dir of a `coordinator serve` with its own etcd: root's settings are there",
)


@contextmanager
def _root(
    data_dir: Path | None,
    etcd: str | None,
    namespace: str,
    settings: EtcdSecurity,
) -> Iterator[Etcd]:
    """A client as etcd's root, for the block's changes to users: exit 2 naming a bad
    option or agent id, 3 when etcd refuses or is away."""
    from coordinator.service.embedded import find_service_etcd

    if data_dir is not None:
        if etcd:
            raise typer.BadParameter("give --data-dir or --etcd, not both", param_hint="--etcd")
        try:
            endpoint, security = find_service_etcd(data_dir.absolute())
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--data-dir") from None
    else:
        endpoint = etcd or DEFAULT_ETCD
        security = checked_security(endpoint, settings)
    client = connect(endpoint, namespace, security)
    try:
        yield client
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="ID") from None
    except CannotManageUsers as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(EXIT_ETCD_UNAVAILABLE) from None
    except EtcdError as exc:
        console.print(f"[red]etcd refused: {exc}[/red]")
        raise typer.Exit(EXIT_ETCD_UNAVAILABLE) from None
    finally:
        client.close()


@with_etcd_security
def agent(
    etcd_settings: EtcdSecurity,  # the --etcd-* options, from `with_etcd_security`
    agent_id: AgentId,
    out: Annotated[Path, typer.Option(help="file to write the password to (made 0600)")],
    data_dir: DataDirOption = None,
    etcd: EtcdOption = None,
    namespace: NamespaceOption = "/coordinator",
) -> None:
    """Make (or renew the password of) an agent's etcd user; prints the user's name.

    Then: `coordinator agent --id ID --etcd-user USER --etcd-password-file FILE`.
    """
    with _root(data_dir, etcd, namespace, etcd_settings) as client:
        if not client.auth_enabled():
            console.print("[yellow]etcd has auth off: the user exists, unchecked[/yellow]")
        credentials = provision_agent(client, agent_id)
        tls = client.security
    write_password_file(out.absolute(), credentials.password)
    # A service's own etcd wants its client certificate too (readable by its user only:
    # an agent of another user needs copies it may read).
    files = {"ca": tls.ca, "cert": tls.cert, "key": tls.key} if data_dir else {}
    options = "".join(f" --etcd-{name} {path}" for name, path in files.items() if path)
    # It runs only assignments the service signed: the service's public key.
    public = (data_dir.absolute() if data_dir else Path("DATA_DIR")) / "signing-key.pub"
    options += f" --service-key {public}"
    console.print(
        f"agent {agent_id}: etcd user {credentials.user!r}, password in {out.absolute()}; "
        f"run `coordinator agent --id {agent_id} --etcd-user {credentials.user} "
        f"--etcd-password-file {out.absolute()}{options}`",
        soft_wrap=True,
    )
    print(credentials.user, flush=True)


@with_etcd_security
def revoke(
    etcd_settings: EtcdSecurity,  # the --etcd-* options, from `with_etcd_security`
    agent_id: AgentId,
    data_dir: DataDirOption = None,
    etcd: EtcdOption = None,
    namespace: NamespaceOption = "/coordinator",
) -> None:
    """Delete an agent's etcd user and role (it can no longer connect; none is fine)."""
    with _root(data_dir, etcd, namespace, etcd_settings) as client:
        revoke_agent(client, agent_id)
    console.print(f"agent {agent_id}: etcd user removed")


@with_etcd_security
def job(
    etcd_settings: EtcdSecurity,  # the --etcd-* options, from `with_etcd_security`
    job_id: Annotated[str, typer.Argument(help="the job's id (its members' --job)")],
    out: Annotated[Path, typer.Option(help="file to write the password to (made 0600)")],
    data_dir: DataDirOption = None,
    etcd: EtcdOption = None,
    namespace: NamespaceOption = "/coordinator",
) -> None:
    """Make (or renew the password of) a job's etcd user, for members started by hand;
    prints the user's name."""
    from coordinator.deploy.k8s import credentials_secret, job_name

    with _root(data_dir, etcd, namespace, etcd_settings) as client:
        credentials = provision_job(client, job_id)
    write_password_file(out.absolute(), credentials.password)
    secret = credentials_secret(job_name(job_id))  # what `coordinator k8s` pods read
    console.print(
        f"job {job_id}: etcd user {credentials.user!r}, password in {out.absolute()}; each "
        f"member: `coordinator worker --job {job_id} --etcd-user {credentials.user} "
        f"--etcd-password-file {out.absolute()} ...`; on Kubernetes: `kubectl create secret "
        f"generic {secret} --from-literal=user={credentials.user} "
        f"--from-file=password={out.absolute()}`",
        soft_wrap=True,
    )
    print(credentials.user, flush=True)


@with_etcd_security
def revoke_job_user(
    etcd_settings: EtcdSecurity,  # the --etcd-* options, from `with_etcd_security`
    job_id: Annotated[str, typer.Argument(help="the job's id")],
    data_dir: DataDirOption = None,
    etcd: EtcdOption = None,
    namespace: NamespaceOption = "/coordinator",
) -> None:
    """Delete a job's etcd user and role (once its members are done; none is fine)."""
    with _root(data_dir, etcd, namespace, etcd_settings) as client:
        revoke_job(client, job_id)
    console.print(f"job {job_id}: etcd user removed")


def api_token(
    role: Annotated[str, typer.Argument(help="read, submit or exec (exec runs programs)")],
    file: Annotated[
        Path | None,
        typer.Option(
            help="the token file to add it to [$COORDINATOR_DATA/api-token, else "
            "./coordinator-data/api-token: where the CLI looks]",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Add a new API token of ROLE to a token file, and print it. Start the service with
    `coordinator serve --token-file FILE` to accept it."""
    from coordinator.client import DATA_ENV, DEFAULT_DATA_DIR
    from coordinator.service.rest.auth import GENERATED_TOKEN_FILE, Role, add_token

    if role not in Role.__members__.values():
        raise typer.BadParameter(f"{role!r} is not read, submit or exec", param_hint="ROLE")
    path = file or Path(os.environ.get(DATA_ENV) or DEFAULT_DATA_DIR) / GENERATED_TOKEN_FILE
    try:
        token = add_token(path.absolute(), Role(role))
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--file") from None
    console.print(
        f"a new {role} token is in {path.absolute()}: start the service with "
        f"`coordinator serve --token-file {path.absolute()}`",
        soft_wrap=True,
    )
    print(token, flush=True)


app.command("agent")(agent)
app.command("revoke-agent")(revoke)
app.command("job")(job)
app.command("revoke-job")(revoke_job_user)
app.command("token")(api_token)
