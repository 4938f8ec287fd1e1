"""A real 3-member etcd cluster on loopback, and cuttable links to it, for fault tests.

Each member is a real etcd process with its own data dir and ports; any can be
SIGKILLed and started again on its data (it rejoins the cluster). Clients reach
the cluster through a `Link`: one loopback proxy per etcd member, all cut at once
to cut that client off from etcd while everyone else still reaches it. Auth is
off: the subject here is faults, not the boundary (tests/system/test_etcd_auth.py).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from coordinator.etcd.server import EtcdServerError, find_etcd_binary, free_port


class CuttableProxy:
    """A TCP proxy on loopback whose connections can all be cut, and refused, at will, or
    frozen: kept open with nothing passing either way (a half-open partition)."""

    def __init__(self, target: str) -> None:
        """`target`: an etcd endpoint, `HOST:PORT` or `https://HOST:PORT` (TLS passes
        through: `endpoint` keeps the scheme, and the server's name, loopback, holds)."""
        scheme, _, address = target.rpartition("://")
        host, _, port = address.rpartition(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        prefix = f"{scheme}://" if scheme else ""
        self.endpoint = f"{prefix}127.0.0.1:{self.listener.getsockname()[1]}"
        self.open = threading.Event()
        self.open.set()
        self.flowing = threading.Event()
        self.flowing.set()
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                client.close()  # refused while cut
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2.0)
            except OSError:  # the target is down: the client sees a refused connection
                client.close()
                continue
            upstream.settimeout(None)
            with self.lock:
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self.flowing.wait()
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                _hang_up(end)

    def cut(self) -> None:
        self.open.clear()
        with self.lock:
            for sock in self.sockets:
                _hang_up(sock)
            self.sockets.clear()

    def restore(self) -> None:
        self.open.set()

    def freeze(self) -> None:
        """Pass nothing, close nothing: the peers learn of it only by their own timeouts."""
        self.flowing.clear()

    def thaw(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self.closed = True
        self.cut()
        self.flowing.set()  # (a pipe held by the freeze ends on its hung-up sockets)
        self.listener.close()


def _hang_up(sock: socket.socket) -> None:
    """Close a connection for real: a bare close() leaves it open while another thread is
    blocked reading it (the peer would wait on a connection that is gone)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class Link:
    """One client's way to the cluster: a proxy per etcd member, cut and restored together."""

    def __init__(self, targets: list[str]) -> None:
        self.proxies = [CuttableProxy(t) for t in targets]

    @property
    def endpoints(self) -> str:
        """As `--etcd` takes them: every member, comma-separated."""
        return ",".join(p.endpoint for p in self.proxies)

    def cut(self) -> None:
        for proxy in self.proxies:
            proxy.cut()

    def restore(self) -> None:
        for proxy in self.proxies:
            proxy.restore()

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()


class EtcdCluster:
    """`size` etcd members on loopback; `endpoints` reaches them directly, `link()` through
    proxies that can be cut."""

    def __init__(self, size: int = 3, startup_timeout: float = 30.0) -> None:
        self.size = size
        self.startup_timeout = startup_timeout
        self.root = Path(tempfile.mkdtemp(prefix="coordinator-etcd-cluster-"))
        self.client_ports = [free_port() for _ in range(size)]
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * size
        self.links: list[Link] = []
        self.token = f"test-{self.root.name}"

    def name(self, index: int) -> str:
        return f"m{index}"

    def peer_url(self, index: int) -> str:
        """Member `index`'s raft endpoint: a unix socket in the cluster's 0700 folder (every
        member runs there), as the product's embedded etcd has (no peer port to reach)."""
        return f"unix://{self.name(index)}.peer:1"

    def client_endpoint(self, index: int) -> str:
        return f"127.0.0.1:{self.client_ports[index]}"

    @property
    def endpoints(self) -> str:
        return ",".join(self.client_endpoint(i) for i in range(self.size))

    def link(self) -> Link:
        """A new cuttable way in for one client (closed with the cluster)."""
        link = Link([self.client_endpoint(i) for i in range(self.size)])
        self.links.append(link)
        return link

    def start(self) -> EtcdCluster:
        for index in range(self.size):
            self._spawn(index)
        for index in range(self.size):
            self.wait_healthy(index)
        return self

    def _spawn(self, index: int) -> None:
        if self.processes[index] is not None:
            raise EtcdServerError(f"etcd member {index} is already running")
        cluster = ",".join(f"{self.name(i)}={self.peer_url(i)}" for i in range(self.size))
        client_url = f"http://{self.client_endpoint(index)}"
        peer_url = self.peer_url(index)
        args = [
            find_etcd_binary(),
            "--name", self.name(index),
            "--data-dir", str(self.root / self.name(index)),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", cluster,
            "--initial-cluster-token", self.token,
            "--initial-cluster-state", "new",  # ignored on a restart: the data dir decides
            "--log-level", "error",
        ]  # fmt: skip
        with open(self.root / f"{self.name(index)}.log", "ab") as log:
            self.processes[index] = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.root
            )

    def _get(self, index: int, path: str) -> str:
        url = f"http://{self.client_endpoint(index)}{path}"
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.read().decode()

    def wait_healthy(self, index: int) -> None:
        """Until member `index` answers healthy (it has a leader and serves)."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            process = self.processes[index]
            if process is not None and process.poll() is not None:
                raise EtcdServerError(f"etcd member {index} exited {process.returncode}")
            try:
                if '"health":"true"' in self._get(index, "/health"):
                    return
            except OSError:
                pass
            time.sleep(0.05)  # polling a child's health endpoint; no event to wait on
        raise EtcdServerError(f"etcd member {index} not healthy in {self.startup_timeout}s")

    def leader(self, timeout: float = 10.0) -> int:
        """The index of the member that is raft leader now (waits for an election)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index in self.running():
                try:
                    if "\netcd_server_is_leader 1" in self._get(index, "/metrics"):
                        return index
                except OSError:
                    pass
            time.sleep(0.05)  # an election is under way; no event to wait on
        raise EtcdServerError(f"no etcd leader within {timeout}s")

    def leases(self) -> list[int]:
        """Every lease the cluster holds (etcd's JSON gateway: our client's protos lack
        LeaseLeases), asked of the first running member that answers."""
        for index in self.running():
            request = urllib.request.Request(
                f"http://{self.client_endpoint(index)}/v3/lease/leases", data=b"{}", method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=2.0) as response:
                    body = json.loads(response.read())
            except OSError:
                continue
            return [int(lease["ID"]) for lease in body.get("leases", [])]
        raise EtcdServerError("no etcd member answered the lease listing")

    def running(self) -> list[int]:
        return [i for i, p in enumerate(self.processes) if p is not None and p.poll() is None]

    def kill(self, index: int) -> None:
        """SIGKILL member `index`, as a crash would."""
        process, self.processes[index] = self.processes[index], None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()

    def restart(self, index: int, wait: bool = True) -> None:
        """Start member `index` again on its data; `wait`: until it is healthy (which
        needs a quorum)."""
        self._spawn(index)
        if wait:
            self.wait_healthy(index)

    def close(self) -> None:
        for link in self.links:
            link.close()
        for index in range(self.size):
            self.kill(index)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
