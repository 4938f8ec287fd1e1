"""etcd's raft peer endpoint is out of every local user's reach, for every embedded etcd.

etcd trusts what arrives on its peer endpoint, down to the user name inside a raft
entry: one `MsgApp` posted there writes as root (tests/support/raft_intruder.py,
standard library only). The embedded etcd's peers use a unix socket in its 0700
data dir, so as `nobody` the intruder is refused at connect, and nothing changes:
not the key it writes, not etcd's raft term. This holds for the service's etcd,
`coordinator run`'s and `coordinator etcd`'s. The intruder itself is shown to
work (as the etcd's owner, who may open the socket), so a refusal means the
boundary, not a broken attack.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import psutil
import pytest
import yaml
from pyetcd import etcdrpc

from coordinator.etcd.client import Etcd
from coordinator.etcd.local_pki import LocalPki
from coordinator.etcd.security import ENV, EtcdSecurity
from coordinator.etcd.server import EmbeddedEtcd, find_etcd_binary, free_port
from coordinator.files import write_private
from coordinator.service.embedded import ServiceEtcd, running_security
from tests.support import raft_intruder
from tests.support.service import ServiceProc, kill_members, stop_service_etcd
from tests.support.wait import wait_until

pytestmark = pytest.mark.one_etcd

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not Path("/usr/bin/python3").exists(),
    reason="acts as nobody: needs root, setpriv and a system python3",
)


@pytest.fixture
def open_parent() -> Iterator[Path]:
    """A directory every user may enter: only the product's own modes keep them out. The
    intruder is copied there, for `nobody` to run."""
    folder = Path(tempfile.mkdtemp(prefix="coordinator-peer-"))
    folder.chmod(0o755)
    intruder = folder / "raft_intruder.py"
    shutil.copy(raft_intruder.__file__, intruder)
    intruder.chmod(0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _clean_environment() -> dict[str, str]:
    """This process's environment without etcd settings: each command makes its own etcd."""
    return {k: v for k, v in os.environ.items() if k not in ENV.values()}


def _status(endpoint: str, security: EtcdSecurity) -> dict[str, object]:
    """etcd's public figures (Maintenance.Status needs no user), in the JSON gateway's
    shape: asked over gRPC with root's TLS files, whatever guards the client port."""
    target = endpoint.removeprefix("https://")
    if endpoint.startswith("https://"):
        files = {name: security.read(name) for name in ("ca", "cert", "key")}
        credentials = grpc.ssl_channel_credentials(
            root_certificates=files["ca"], private_key=files["key"], certificate_chain=files["cert"]
        )
        channel = grpc.secure_channel(target, credentials)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        status = etcdrpc.MaintenanceStub(channel).Status(etcdrpc.StatusRequest(), timeout=10)
    header = status.header
    return {
        "header": {"cluster_id": str(header.cluster_id), "member_id": str(header.member_id)},
        "version": status.version,
        "raftTerm": str(status.raftTerm),
        "raftIndex": str(status.raftIndex),
    }


def _listeners(pid: int) -> list[str]:
    """Every endpoint process `pid` listens on, as the intruder's targets: each TCP port,
    each unix stream socket (a relative name resolved in its working directory)."""
    process = psutil.Process(pid)
    targets = [
        f"http://{c.laddr.ip}:{c.laddr.port}"
        for c in process.net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    ]
    for connection in process.net_connections("unix"):
        name = connection.laddr
        if connection.type == socket.SOCK_STREAM and name and not connection.raddr:
            targets.append(
                "unix:" + (name if name.startswith("@") else str(process.cwd() / Path(name)))
            )
    return targets


def _intrude(
    open_parent: Path, etcd_pid: int, status: dict[str, object], key: str
) -> dict[str, str]:
    """Run the intruder as `nobody` against every listener of etcd, handing it etcd's
    public figures; what each listener answered."""
    answers = {}
    for target in _listeners(etcd_pid):
        result = subprocess.run(
            [*NOBODY, "/usr/bin/python3", str(open_parent / "raft_intruder.py"),
             json.dumps(status), target, key, '{"spec": {"id": "evil", "kind": "command"}}'],
            capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        answers[target] = result.stdout.strip()
    return answers


def _assert_nothing_changes(
    open_parent: Path, etcd_pid: int, endpoint: str, root: EtcdSecurity, key: str
) -> None:
    status = _status(endpoint, root)
    answers = _intrude(open_parent, etcd_pid, status, key)
    with Etcd(endpoint, namespace="", security=root) as etcd:
        assert etcd.get(key) is None, answers
    # No stranger's message reached raft (it would have made etcd follow a new term).
    assert _status(endpoint, root)["raftTerm"] == status["raftTerm"], answers
    peer = [target for target in answers if target.startswith("unix:")]
    assert [Path(target).name for target in peer] == ["peer:1"], answers
    for target, answer in answers.items():
        if target.startswith("unix:"):
            assert "Permission denied" in answer, (target, answer)
        else:  # the client (and any metrics) port: no raft handler there
            assert not answer.startswith("posted 2"), (target, answer)


def _etcd_child(pid: int) -> psutil.Process:
    """The etcd a command started, once it listens."""

    def found() -> psutil.Process | None:
        for child in psutil.Process(pid).children(recursive=True):
            try:
                if child.name() == "etcd" and child.net_connections("inet"):
                    return child
            except psutil.NoSuchProcess:
                continue
        return None

    return wait_until(found, 60, "the command's etcd to listen")


def _root_of(etcd: psutil.Process) -> tuple[str, EtcdSecurity]:
    """The client endpoint and root settings of an EmbeddedEtcd, from its argv."""
    argv = etcd.cmdline()
    endpoint = argv[argv.index("--listen-client-urls") + 1].split(",")[0].removeprefix("http://")
    data = Path(argv[argv.index("--data-dir") + 1]).parent
    root = EtcdSecurity(user="root", password_file=str(data / "root.password"))
    pki = LocalPki(data / "tls")
    if not endpoint.startswith("https://"):
        return endpoint, root
    return endpoint, replace(
        root, ca=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key)
    )


def test_the_intruder_writes_as_root_when_it_reaches_the_peer_endpoint() -> None:
    """The control: etcd's owner opens the socket, and one message writes as root over
    auth. So what stops `nobody` below is the socket's place, not a broken message."""
    with EmbeddedEtcd() as server:
        assert server.auth
        target = f"unix:{server.data_dir / 'peer:1'}"
        status = json.dumps(_status(server.endpoint, server.security))
        raft_intruder.main(status, target, "/forged", "as root")
        with Etcd(server.endpoint, namespace="", security=server.security) as etcd:
            written = wait_until(lambda: etcd.get("/forged"), 10, "the forged put")
            assert written.value == b"as root"


def test_an_embedded_etcd_listens_for_peers_on_no_tcp_port() -> None:
    with EmbeddedEtcd() as server:
        assert server.process is not None
        connections = psutil.Process(server.process.pid).net_connections("inet")
        listening = {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
        # The client port, and with TLS the plain health port (/health and /metrics only).
        assert listening == {server.client_port, server.health_port}
        assert (server.data_dir / "peer:1").is_socket()
        assert oct(server.data_dir.stat().st_mode & 0o777) == "0o700"


def test_the_peer_socket_works_in_a_data_dir_past_the_socket_path_limit(tmp_path: Path) -> None:
    """A unix socket's name holds 107 bytes: the peer URL is relative to etcd's working
    directory, so a long data dir path (a deep home, pytest's tmp_path) still starts."""
    data = tmp_path / ("d" * 120) / "etcd"
    assert len(str(data / "peer:1")) > 107
    with EmbeddedEtcd(data, auth=False) as server:
        with Etcd(server.endpoint, namespace="", security=server.security) as etcd:
            assert etcd.put("/k", "v") > 0
        assert (data / "peer:1").is_socket()


@needs_root
def test_nobody_cannot_reach_the_services_etcd_peers(open_parent: Path, namespace: str) -> None:
    data = open_parent / "service"
    data.mkdir()
    service = ServiceProc("", namespace, data)
    try:
        service.ready()
        record = json.loads((data / "etcd.json").read_text())
        root = running_security(record)  # as the service records how to reach it
        key = f"{namespace}/api/jobs/evil"
        _assert_nothing_changes(open_parent, record["pid"], record["endpoint"], root, key)
        assert service.http.get("/v1/jobs/evil").status_code == 404
    finally:
        service.stop()
        kill_members(data)
        stop_service_etcd(data)


@needs_root
@pytest.mark.parametrize(
    "command",
    [["run", "--workers", "1", "--", "sleep", "600"], ["etcd"]],
    ids=["coordinator run", "coordinator etcd"],
)
def test_nobody_cannot_reach_a_commands_etcd_peers(open_parent: Path, command: list[str]) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator", *command],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        env=_clean_environment(), start_new_session=True,
    )  # fmt: skip
    try:
        etcd = _etcd_child(process.pid)
        endpoint, root = _root_of(etcd)
        _assert_nothing_changes(open_parent, etcd.pid, endpoint, root, "/evil")
    finally:
        descendants = psutil.Process(process.pid).children(recursive=True)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        for child in descendants:  # etcd and members run in sessions of their own
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(descendants, timeout=10)


# -- compose's etcd: peer TLS with client certificates, on a real etcd ------------------

COMPOSE = Path(__file__).parents[2] / "compose"


def _compose_etcd_args(compose_file: str, secrets: Path, data: Path) -> tuple[list[str], int, int]:
    """The etcd command line of `compose_file`, as it is but for host paths and free ports
    (its secrets from `secrets`, its data in `data`); with the client and peer ports."""
    document = yaml.safe_load((COMPOSE / compose_file).read_text())
    files = {
        name: secrets / Path(entry["file"]).name
        for name, entry in yaml.safe_load((COMPOSE / "compose.yaml").read_text())["secrets"].items()
    }
    client, peer = free_port(), free_port()
    args = [find_etcd_binary()]
    for arg in document["services"]["etcd"]["command"][1:]:
        flag, _, value = arg.partition("=")
        if value.startswith("/run/secrets/"):
            value = str(files[value.removeprefix("/run/secrets/")])
        elif flag == "--data-dir":
            value = str(data)
        value = value.replace("0.0.0.0:2379", f"127.0.0.1:{client}")
        value = value.replace("etcd:2379", f"127.0.0.1:{client}")
        value = value.replace("127.0.0.1:2380", f"127.0.0.1:{peer}")
        args.append(f"{flag}={value}" if value else flag)
    return args, client, peer


def _get(url: str, ca: Path, cert: Path | None = None, key: Path | None = None) -> int:
    """The status of GET `url` over TLS trusting `ca`, presenting `cert` if given."""
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    with urllib.request.urlopen(url, timeout=5, context=context) as response:
        return int(response.status)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
@pytest.mark.parametrize("compose_file", ["compose.yaml", "compose.client-certs.yaml", "ddp.yaml"])
def test_composes_etcd_refuses_a_peer_without_a_certificate_of_the_peer_ca(
    compose_file: str, tmp_path: Path
) -> None:
    """compose's etcd command line on a real etcd, with init-secrets.sh's files: its peer
    port answers a peer with the peer certificate, and refuses one with none, or with a
    certificate of the clients' CA."""
    secrets = tmp_path / "secrets"
    made = subprocess.run(
        [str(COMPOSE / "init-secrets.sh"), str(secrets)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    args, client, peer = _compose_etcd_args(compose_file, secrets, tmp_path / "etcd")
    assert (
        f"--listen-peer-urls=https://127.0.0.1:{peer}" in args and "--peer-client-cert-auth" in args
    )
    log = (tmp_path / "etcd.log").open("wb")
    etcd = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ca, peer_ca = secrets / "ca.pem", secrets / "peer-ca.pem"
        own = (secrets / "etcd.pem", secrets / "etcd-key.pem")  # a client certificate too

        def healthy() -> bool:
            assert etcd.poll() is None, (tmp_path / "etcd.log").read_text()[-2000:]
            try:
                return _get(f"https://127.0.0.1:{client}/health", ca, *own) == 200
            except OSError:
                return False

        wait_until(healthy, 30, "compose's etcd to answer")
        members = f"https://127.0.0.1:{peer}/members"
        assert (
            _get(members, peer_ca, secrets / "etcd-peer.pem", secrets / "etcd-peer-key.pem") == 200
        )
        for certificate in [(None, None), (secrets / "client.pem", secrets / "client-key.pem")]:
            with pytest.raises(urllib.error.URLError) as refused:
                _get(members, peer_ca, *certificate)
            assert isinstance(refused.value.reason, (ssl.SSLError, ConnectionError)), refused
    finally:
        etcd.kill()
        etcd.wait()
        log.close()


def test_a_services_etcd_left_with_a_peer_port_by_an_older_version_is_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The service's etcd outlives the service, so one an older version started (a TCP
    peer port) would stay open across an upgrade. A service that finds one restarts it
    on the same data and client port (its members keep their endpoint), peers on the
    socket, and says so."""
    data = tmp_path / "service"
    data.mkdir(mode=0o700)
    old_peer = f"http://127.0.0.1:{free_port()}"
    older = [
        "--listen-peer-urls", old_peer,
        "--initial-advertise-peer-urls", old_peer,
        "--initial-cluster", f"embedded={old_peer}",
    ]  # fmt: skip
    old = EmbeddedEtcd(data / "etcd", outlives_owner=True, extra_args=older).start()
    replaced = None
    try:
        assert old.process is not None
        old_process = psutil.Process(old.process.pid)
        # The client port, the (TLS) client port's plain health port, and the peer port.
        assert len(_listening_ports(old_process)) == 3
        record = {
            "pid": old_process.pid,
            "started": old_process.create_time(),
            "endpoint": old.endpoint,
            "user": "root",
            "password_file": str(old.password_file),
            **{name: getattr(old.security, name) for name in ("ca", "cert", "key")},
        }
        write_private(data / "etcd.json", json.dumps(record))
        with Etcd(old.endpoint, namespace="", security=old.security) as etcd:
            etcd.put("/kept", "a job record")
        replaced = ServiceEtcd(data)
        assert replaced.endpoint == old.endpoint
        assert "has a TCP peer port: restarting it" in caplog.text
        assert not old_process.is_running()
        assert replaced.server is not None and replaced.server.process is not None
        ports = _listening_ports(psutil.Process(replaced.server.process.pid))
        assert sorted(ports) == sorted([old.client_port, replaced.server.health_port])
        with Etcd(replaced.endpoint, namespace="", security=replaced.security) as etcd:
            kept = etcd.get("/kept")
            assert kept is not None and kept.value == b"a job record"
        assert json.loads((data / "etcd.json").read_text())["pid"] == replaced.server.process.pid
    finally:
        if replaced is not None:
            replaced.stop()
        old.kill()


def _listening_ports(process: psutil.Process) -> list[int]:
    return sorted(
        c.laddr.port for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN
    )
