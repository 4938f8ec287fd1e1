"""The certificates of an etcd the product starts: its own CA, etcd's server certificate
and one client certificate, all in etcd's (owner-only) data dir.

etcd 3.5 answers some calls without checking any user: raising or disarming an alarm,
listing leases, keeping any lease alive, compacting. A password cannot guard those, so
the client port itself is closed: etcd runs with `--client-cert-auth`, and only a
process that can read the client certificate's key (the owner: the service, its
members, `coordinator credentials`) gets through the TLS handshake. A `command` program
under a uid of its own (`--run-as-uids`) and every other local user cannot.

The client certificate opens the connection only: its CN names no etcd user, so it
grants no key; every client still authenticates with its own user and password.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: The client certificate's CN: no etcd user has this name (see the module docstring).
TRANSPORT_CN = "coordinator-transport"
_VALID = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class LocalPki:
    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def server_cert(self) -> Path:
        return self.folder / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.folder / "server.key"

    @property
    def client_cert(self) -> Path:
        return self.folder / "client.crt"

    @property
    def client_key(self) -> Path:
        return self.folder / "client.key"

    def ensure(self) -> LocalPki:
        """Make the files once (kept across restarts: clients hold the CA); returns self."""
        if all(p.exists() for p in (self.ca, self.server_cert, self.server_key,
                                    self.client_cert, self.client_key)):  # fmt: skip
            return self
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "coordinator local etcd CA")])
        ca = (
            _builder(ca_name, ca_name, ca_key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_usage(cert_sign=True), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        server_key = ec.generate_private_key(ec.SECP256R1())
        server = (
            _builder(_cn("localhost"), ca_name, server_key.public_key())
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(_usage(), critical=True)
            # etcd checks its own certificate as a client too (its gateway, its health).
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        client_key = ec.generate_private_key(ec.SECP256R1())
        client = (
            _builder(_cn(TRANSPORT_CN), ca_name, client_key.public_key())
            .add_extension(_usage(), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        # The CA's key is not kept: nothing more is ever signed.
        _write(self.server_key, _pem_key(server_key))
        _write(self.client_key, _pem_key(client_key))
        _write(self.server_cert, server.public_bytes(serialization.Encoding.PEM))
        _write(self.client_cert, client.public_bytes(serialization.Encoding.PEM))
        _write(self.ca, ca.public_bytes(serialization.Encoding.PEM))  # last: the files are whole
        return self


def _cn(name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALID)
    )


def _usage(cert_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=not cert_sign, key_cert_sign=cert_sign,
        crl_sign=cert_sign, encipher_only=False, decipher_only=False,
    )  # fmt: skip


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
