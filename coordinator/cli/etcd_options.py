"""What every command that reaches etcd shares: --etcd; the --etcd-* security options,
declared once and added to each such command by `with_etcd_security`, and their check;
and the connection that ends the command with exit 3 when etcd cannot be reached."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer

from coordinator.cli.options import console
from coordinator.etcd.client import Etcd
from coordinator.etcd.connection import parse_endpoints
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.security import ENV, EtcdSecurity, SecurityError
from coordinator.exit_codes import EXIT_ETCD_UNAVAILABLE

#: The endpoints of a command given no --etcd (an etcd on this host's loopback).
DEFAULT_ETCD = "127.0.0.1:2379"
EtcdOption = Annotated[
    str | None,
    typer.Option(
        "--etcd",
        envvar="COORDINATOR_ETCD",
        help="etcd endpoints HOST:PORT[,HOST:PORT...]",
        show_default=False,
    ),
]
#: The parameter of a command wrapped by `with_etcd_security` that gets the settings.
SECURITY_PARAMETER = "etcd_settings"

#: EtcdSecurity's field -> its option's help; the option is `--etcd-<field>`, its
#: variable `ENV[field]`.
_HELP = {
    "ca": "CA bundle (PEM) that signed etcd's certificate, for https:// endpoints "
    "[the system's roots]",
    "cert": "client certificate (PEM), when etcd runs with --client-cert-auth",
    "key": "the client certificate's key",
    "user": "etcd user, when etcd has auth enabled",
    "password_file": "file holding the etcd user's password (never given on the command line)",
}


def _security_option(field: str) -> inspect.Parameter:
    option = typer.Option(
        "--etcd-" + field.replace("_", "-"), envvar=ENV[field], help=_HELP[field],
        show_default=False,
    )  # fmt: skip
    return inspect.Parameter(
        f"etcd_{field}",
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        default=None,
        annotation=Annotated[str | None, option],
    )


def with_etcd_security(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with the --etcd-* options after its own (the order of its --help), which
    it gets as one unchecked `EtcdSecurity`, its `etcd_settings` parameter."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != SECURITY_PARAMETER]
    options = [_security_option(field) for field in _HELP]

    @functools.wraps(command)
    def wrapper(**given: Any) -> None:
        settings = EtcdSecurity(**{field: given.pop(f"etcd_{field}") for field in _HELP})
        command(**given, **{SECURITY_PARAMETER: settings})

    wrapper.__signature__ = signature.replace(parameters=[*own, *options])  # type: ignore[attr-defined]
    return wrapper


def checked_security(endpoints: str, settings: EtcdSecurity) -> EtcdSecurity:
    """The --etcd-* settings, checked (a bad one is a usage error naming it) and
    exported into the environment, where the members this command starts find them."""
    try:
        parsed = parse_endpoints(endpoints)
    except ValueError:  # bad endpoints: the command names them itself
        parsed = []
    try:
        settings.check()
        if parsed:
            settings.check_endpoints(parsed)
    except SecurityError as exc:
        raise typer.BadParameter(str(exc), param_hint=exc.field) from None
    settings.export()
    return settings


def connect(endpoints: str, namespace: str, security: EtcdSecurity, probe: str = "") -> Etcd:
    """A client of etcd (`probe`: see `Etcd`), or the command ends: exit 3, saying why."""
    try:
        return Etcd(endpoints, namespace=namespace, security=security, probe=probe)
    except EtcdError as exc:
        console.print(f"[red]cannot reach etcd: {exc}[/red]")
        raise typer.Exit(EXIT_ETCD_UNAVAILABLE) from None
