"""The service's own etcd when none is given: one per data directory, outliving the service.

Members keep talking to etcd while the service restarts, so this etcd must not
die with it: it runs in a session of its own, and `<data>/etcd.json` records its
pid, start time, port and root password file. A service started again on the
same directory finds it there and uses it; only when none runs is a new one
started (on the same data, so every job record is still there). One that an
older version started, with a TCP peer port open to every local user, is
restarted on the same data and client port (members keep their endpoint). etcd has auth
on (`EmbeddedEtcd`), and the data directory and the record are its owner's only:
they lead to the root password.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import psutil

from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.server import PEER_URL, EmbeddedEtcd, peer_url_of
from coordinator.etcd.users import ROOT
from coordinator.files import write_private

log = logging.getLogger(__name__)
_TLS_FILES = ("ca", "cert", "key")


class ServiceEtcd:
    def __init__(self, data_dir: Path) -> None:
        self.state = data_dir / "etcd.json"
        self.server: EmbeddedEtcd | None = None
        running = self._running()
        port = None
        if running is not None:
            if not self._peer_port_open():
                self.endpoint, self.security = running
                return
            port = int(running[0].rsplit(":", 1)[1])
            log.warning(
                "the etcd at %s (started by an older version) has a TCP peer port: "
                "restarting it on the same data and port, peers on a private socket",
                running[0],
            )
            self._stop_recorded()
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        data_dir.chmod(0o700)  # logs, artifacts and the way to etcd's root password
        self.server = EmbeddedEtcd(data_dir / "etcd", outlives_owner=True, client_port=port).start()
        assert self.server.process is not None
        pid = self.server.process.pid
        self.endpoint, self.security = self.server.endpoint, self.server.security
        record = {
            "pid": pid,
            "started": psutil.Process(pid).create_time(),
            "endpoint": self.endpoint,
            "user": ROOT,
            "password_file": str(self.server.password_file.absolute()),
            # The client certificate etcd wants (`coordinator.etcd.local_pki`).
            **{f: getattr(self.security, f) for f in _TLS_FILES},
        }
        write_private(self.state, json.dumps(record))

    def _running(self) -> tuple[str, EtcdSecurity] | None:
        """The endpoint and root settings of the etcd the record names, if it still runs."""
        try:
            record = json.loads(self.state.read_text())
            process = psutil.Process(record["pid"])
            if abs(process.create_time() - record["started"]) < 0.05 and process.is_running():
                return str(record["endpoint"]), running_security(record)
        except (OSError, ValueError, KeyError, TypeError, psutil.NoSuchProcess):
            pass
        return None

    def _peer_port_open(self) -> bool:
        """Whether the recorded etcd listens for raft peers elsewhere than its socket."""
        try:
            argv = psutil.Process(json.loads(self.state.read_text())["pid"]).cmdline()
        except (OSError, ValueError, KeyError, psutil.Error):
            return False
        return peer_url_of(argv) != PEER_URL

    def _stop_recorded(self) -> None:
        """Stop the etcd the record names (if it is still that process)."""
        try:
            record = json.loads(self.state.read_text())
            process = psutil.Process(record["pid"])
            if abs(process.create_time() - record["started"]) < 0.05:
                process.terminate()
                try:
                    process.wait(10)
                except psutil.TimeoutExpired:
                    process.kill()
                    process.wait(10)
        except (OSError, ValueError, KeyError, psutil.Error):
            pass

    def stop(self) -> None:
        """Stop etcd (whether this service started it or found it running)."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        else:
            self._stop_recorded()
        self.state.unlink(missing_ok=True)


def running_security(record: dict[str, object]) -> EtcdSecurity:
    """The root settings an `etcd.json` record names (none: an etcd without auth)."""
    password_file = record.get("password_file")
    if password_file is None:
        return EtcdSecurity()
    if not isinstance(password_file, str) or record.get("user") != ROOT:
        raise ValueError("etcd.json: user and password_file are not root's")
    files = {f: record.get(f) for f in _TLS_FILES}
    if not all(v is None or isinstance(v, str) for v in files.values()):
        raise ValueError(f"etcd.json: {', '.join(_TLS_FILES)} are not paths")
    return EtcdSecurity(user=ROOT, password_file=password_file, **files)  # type: ignore[arg-type]


def find_service_etcd(data_dir: Path) -> tuple[str, EtcdSecurity]:
    """The endpoint and root settings of the etcd a `serve` runs in `data_dir`, for the
    commands that manage it (`coordinator credentials`); ValueError naming the cause."""
    state = data_dir / "etcd.json"
    try:
        record = json.loads(state.read_text())
        endpoint = record["endpoint"]
    except OSError as exc:
        raise ValueError(f"no etcd of a `coordinator serve` in {data_dir}: {exc}") from None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{state} is not an etcd record") from None
    if not isinstance(endpoint, str):
        raise ValueError(f"{state}: endpoint is not text")
    return endpoint, running_security(record)
