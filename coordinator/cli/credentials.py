"""`coordinator credentials`: etcd users of least privilege, made by an operator as root.

An agent's user may touch its registration, its assignments and its reports, read
the placements' commits, and nothing of any job or other agent (`agent_grants`; run
`agent` again for an older user: it adds what the agent may now need). Root's
settings come from the data dir of a `coordinator serve` with its own etcd
(`--data-dir`), or from the `--etcd-*` options.
"""

from __future__ import annotations

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
    revoke_agent,
    write_password_file,
)
from coordinator.exit_codes import EXIT_ETCD_UNAVAILABLE

app = typer.Typer(
    help="etcd users of least privilege (for agents); made with etcd's root user.",
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
    write_password_file(out.absolute(), credentials.password)
    console.print(
        f"agent {agent_id}: etcd user {credentials.user!r}, password in {out.absolute()}; "
        f"run `coordinator agent --id {agent_id} --etcd-user {credentials.user} "
        f"--etcd-password-file {out.absolute()}`"
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


app.command("agent")(agent)
app.command("revoke-agent")(revoke)
