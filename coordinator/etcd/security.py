"""How to reach a secured etcd: TLS files and user/password auth, as one value.

The settings come from options or from environment variables, and are exported
back into the environment, because that is how they reach the members a
launcher starts (`run`'s workers, the service's and an agent's local members
inherit the environment). The password itself never travels: only the path of
a file holding it, read when authenticating, so it is not in argv, not in the
environment, and a rotated Secret is picked up on the next authentication.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from pyetcd import etcdrpc

from coordinator.field_error import FieldError

#: field -> environment variable; the options are `--etcd-<field>` (`password-file`).
ENV = {
    "ca": "COORDINATOR_ETCD_CA",
    "cert": "COORDINATOR_ETCD_CERT",
    "key": "COORDINATOR_ETCD_KEY",
    "user": "COORDINATOR_ETCD_USER",
    "password_file": "COORDINATOR_ETCD_PASSWORD_FILE",
}


def _option(name: str) -> str:
    return "--etcd-" + name.replace("_", "-")


class SecurityError(FieldError):
    """A setting is unusable; `field` names the option to fix (`--etcd-cert`, ...)."""


@dataclass(frozen=True)
class EtcdSecurity:
    """TLS and auth settings; all empty means a plain, unauthenticated etcd."""

    ca: str | None = None  # PEM CA bundle that signed etcd's certificate [system roots]
    cert: str | None = None  # PEM client certificate, for etcd's --client-cert-auth
    key: str | None = None  # its private key
    user: str | None = None  # etcd user, for etcd's auth
    password_file: str | None = None  # file whose content (one line) is the password

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EtcdSecurity:
        """The settings in COORDINATOR_ETCD_CA, _CERT, _KEY, _USER and _PASSWORD_FILE."""
        env = os.environ if environ is None else environ
        return cls(**{name: env.get(var) or None for name, var in ENV.items()})

    @property
    def tls_files(self) -> bool:
        return bool(self.ca or self.cert or self.key)

    @property
    def authenticates(self) -> bool:
        return self.user is not None

    def check(self) -> EtcdSecurity:
        """Refuse unusable settings before anything connects; returns self."""
        if bool(self.cert) != bool(self.key):
            missing = "key" if self.cert else "cert"
            raise SecurityError(
                _option(missing), "a client certificate needs both --etcd-cert and --etcd-key"
            )
        if self.user and not self.password_file:
            raise SecurityError(
                "--etcd-password-file",
                f"etcd user {self.user!r} needs --etcd-password-file (the password is never "
                "given on the command line); with a client certificate and no password, "
                "leave --etcd-user out: etcd then takes the user from the certificate's CN",
            )
        if self.password_file and not self.user:
            raise SecurityError("--etcd-user", "--etcd-password-file needs --etcd-user")
        for field in fields(self):
            path = getattr(self, field.name)
            if field.name == "user" or not path:
                continue
            if not os.access(path, os.R_OK) or not Path(path).is_file():
                raise SecurityError(_option(field.name), f"cannot read {path}")
        return self

    def check_endpoints(self, endpoints: list[str]) -> None:
        """TLS files with plain endpoints would silently go unused: refuse that."""
        if self.tls_files and not any(e.startswith("https://") for e in endpoints):
            raise SecurityError(
                "--etcd",
                "--etcd-ca, --etcd-cert and --etcd-key are for TLS: give the endpoints as "
                "https://HOST:PORT",
            )

    def read(self, name: str) -> bytes | None:
        """The content of the file setting `name` (`ca`, `cert`, `key`), if set."""
        path = getattr(self, name)
        return Path(path).read_bytes() if path else None

    def password(self) -> str:
        """The password, read now (a mounted Secret may have been rotated)."""
        assert self.password_file is not None
        return Path(self.password_file).read_text().rstrip("\r\n")

    def export(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Put the settings into the environment, for the members launchers start."""
        env = os.environ if environ is None else environ
        for name, var in ENV.items():
            value = getattr(self, name)
            if value:
                # Absolute: a member may run in another working directory.
                env[var] = value if name == "user" else str(Path(value).absolute())
            else:
                env.pop(var, None)


def token_rejected(code: grpc.StatusCode, details: str) -> bool:
    """etcd no longer takes our token (expired, issued by another member, or older than
    a change to users and roles): authenticating again fixes it."""
    return (
        code == grpc.StatusCode.UNAUTHENTICATED
        or "invalid auth token" in details
        or "revision of auth store is old" in details
        or "user name is empty" in details  # auth was enabled after we connected
    )


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class TokenAuth(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Sends etcd's auth token as `token` metadata on every call, streams included.

    An interceptor, so the library's watch stream and the lease keepalive carry
    the token too without knowing of it. The token comes from the Auth service's
    Authenticate call, made on first use and again after etcd rejected the token
    (an expired stream call marks it, so the next keepalive authenticates anew).
    """

    def __init__(self, security: EtcdSecurity, timeout: float) -> None:
        self.security, self.timeout = security, timeout
        self._lock = threading.Lock()
        self._stub: etcdrpc.AuthStub | None = None
        self._token: str | None = None  # "" when etcd has auth disabled
        self.authentications = 0

    def bind(self, channel: grpc.Channel) -> None:
        """Authenticate on this (not intercepted) channel from now on: a simple token
        is only valid at the etcd member that issued it."""
        with self._lock:
            self._stub, self._token = etcdrpc.AuthStub(channel), None

    def invalidate(self, token: str | None = None) -> None:
        """Forget the token (only if it is still `token`, when given)."""
        with self._lock:
            if token is None or token == self._token:
                self._token = None

    def token(self, timeout: float | None = None) -> str:
        """The current token, authenticating first if there is none (for at most
        `timeout`, the call's own deadline, or this client's request timeout).

        The lock is not held while etcd answers: a member without a leader answers an
        Authenticate only at its deadline, and every other call (a keepalive, a watch,
        a move to the next member) would wait behind it. Raises grpc.RpcError as the
        call would (etcd's refusal of the password, or a TLS failure); an unreadable
        password file raises SecurityError.
        """
        with self._lock:
            if self._token is not None:
                return self._token
            stub = self._stub
        assert stub is not None and self.security.user is not None
        try:
            password = self.security.password()
        except OSError as exc:
            raise SecurityError(
                "--etcd-password-file", f"cannot read the etcd password file: {exc}"
            ) from None
        request = etcdrpc.AuthenticateRequest(name=self.security.user, password=password)
        try:
            deadline = min(timeout or self.timeout, self.timeout)
            token = stub.Authenticate(request, timeout=deadline).token
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:  # type: ignore[attr-defined]
                raise
            token = ""  # "authentication is not enabled": nothing to send
        with self._lock:
            self.authentications += 1
            if self._stub is stub:  # (not for a connection the client has left meanwhile)
                self._token = token
        return token

    def _details(self, details: grpc.ClientCallDetails) -> tuple[grpc.ClientCallDetails, str]:
        token = self.token(details.timeout)
        if not token:
            return details, token
        metadata = [*(details.metadata or ()), ("token", token)]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        ), token  # fmt: skip

    def _watch(self, call: Any, token: str) -> Any:
        """A stream learns of a rejected token only when it ends: forget the token then."""

        def done(finished: Any) -> None:
            code, details = finished.code(), finished.details() or ""
            if code is not None and token_rejected(code, details):
                self.invalidate(token)

        call.add_done_callback(done)
        return call

    def _one_response(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        details, _ = self._details(client_call_details)
        return continuation(details, request)

    def _response_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        details, token = self._details(client_call_details)
        return self._watch(continuation(details, request), token)

    # gRPC calls one method per request and response kind (a request may be an iterator);
    # only the response kind matters here: a stream learns of a rejected token at its end.
    intercept_unary_unary = intercept_stream_unary = _one_response
    intercept_unary_stream = intercept_stream_stream = _response_stream
