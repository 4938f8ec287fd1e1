"""What a request to etcd can end in, named so a caller can tell a refusal that
retries cannot fix (a TLS or auth setting, a lost lease) from etcd being away."""

from __future__ import annotations

import grpc

from coordinator.etcd.security import EtcdSecurity


class EtcdError(RuntimeError):
    """etcd refused a request for a reason that retrying will not fix."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered within the retry window; `reason` is the last failure."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class LeaseNotFound(EtcdError):
    """The lease a write was bound to has expired or been revoked."""


class EtcdRefused(EtcdUnavailable):
    """etcd answered but will not serve us: a TLS or auth setting is wrong.

    An `EtcdUnavailable`, so every command exits 3 on it as when etcd is down,
    with a message that names the cause instead of a timeout. `cause` is one of
    `credentials`, `client-certificate`, `untrusted-server`, `permission-denied`.
    """

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def refusal(
    code: grpc.StatusCode,
    details: str,
    *,
    urls: list[str],
    security: EtcdSecurity,
    authenticates: bool,
    probe_prefix: str,
) -> EtcdRefused | None:
    """The TLS or auth setting a failure points at, if it is one (retries cannot fix it)."""
    at = ",".join(urls)
    user = security.user
    who = f"user {user!r}" if user else "the client certificate's user (its CN)"
    if code == grpc.StatusCode.UNAVAILABLE and "handshake failed" in details.lower():
        # gRPC's text ends with OpenSSL's reason: "...OPENSSL_internal:<REASON>: OK".
        reason = details.rsplit("OPENSSL_internal:", 1)[-1].removesuffix(": OK")
        if "CERTIFICATE_VERIFY_FAILED" in details or "peer certificate" in details:
            bundle = security.ca or "the system's CA roots"
            return EtcdRefused(
                "untrusted-server",
                f"untrusted server: the certificate of etcd at {at} is not signed by the "
                f"CA in {bundle}, or does not name that host (--etcd-ca): {reason}",
            )
        if "ALERT" in details:  # etcd's alert: a bad, missing or unknown certificate
            if not security.cert:
                return EtcdRefused(
                    "client-certificate",
                    f"missing client certificate: etcd at {at} requires one "
                    f"(--etcd-cert and --etcd-key): {reason}",
                )
            return EtcdRefused(
                "client-certificate",
                f"client certificate refused: etcd at {at} does not accept "
                f"{security.cert} (signed by a CA etcd does not trust, or expired): "
                f"{reason}",
            )
    if code == grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in details:
        return EtcdRefused(
            "credentials",
            f"wrong credentials: etcd at {at} rejected {who} with the password in "
            f"{security.password_file} (--etcd-user, --etcd-password-file)",
        )
    if "user name is empty" in details and not authenticates:
        return EtcdRefused(  # (with credentials, the token was lost: authenticate again)
            "credentials",
            f"missing credentials: etcd at {at} has auth enabled; give --etcd-user and "
            "--etcd-password-file (or a client certificate whose CN is an etcd user)",
        )
    if code == grpc.StatusCode.PERMISSION_DENIED and details.startswith("coordinator proxy:"):
        return EtcdRefused(  # a program's call its member's proxy does not forward
            "permission-denied",
            f"permission denied by this program's member ({at}): "
            f"{details.removeprefix('coordinator proxy: ')}",
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return EtcdRefused(
            "permission-denied",
            f"permission denied: etcd at {at} does not let {who} read and write "
            f"{probe_prefix} (grant it a role on that prefix: docs/security.md)",
        )
    return None
