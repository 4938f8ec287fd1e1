"""The service's own etcd when none is given: one per data directory, outliving the service.

Members keep talking to etcd while the service restarts, so this etcd must not
die with it: it runs in a session of its own, and `<data>/etcd.json` records its
pid, start time, port and root password file. A service started again on the
same directory finds it there and uses it; only when none runs is a new one
started (on the same data, so every job record is still there). etcd has auth
on (`EmbeddedEtcd`), and the data directory and the record are its owner's only:
they lead to the root password.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from coordinator.etcd.security import EtcdSecurity
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.etcd.users import ROOT
from coordinator.files import write_private


class ServiceEtcd:
    def __init__(self, data_dir: Path) -> None:
        self.state = data_dir / "etcd.json"
        self.server: EmbeddedEtcd | None = None
        running = self._running()
        if running is not None:
            self.endpoint, self.security = running
            return
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        data_dir.chmod(0o700)  # logs, artifacts and the way to etcd's root password
        self.server = EmbeddedEtcd(data_dir / "etcd", outlives_owner=True).start()
        assert self.server.process is not None
        pid = self.server.process.pid
        self.endpoint, self.security = self.server.endpoint, self.server.security
        record = {
            "pid": pid,
            "started": psutil.Process(pid).create_time(),
            "endpoint": self.endpoint,
            "user": ROOT,
            "password_file": str(self.server.password_file.absolute()),
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

    def stop(self) -> None:
        """Stop etcd (whether this service started it or found it running)."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        else:
            try:
                record = json.loads(self.state.read_text())
                process = psutil.Process(record["pid"])
                if abs(process.create_time() - record["started"]) < 0.05:
                    process.terminate()
                    process.wait(10)
            except (OSError, ValueError, KeyError, psutil.Error):
                pass
        self.state.unlink(missing_ok=True)


def running_security(record: dict[str, object]) -> EtcdSecurity:
    """The root settings an `etcd.json` record names (none: an etcd without auth)."""
    password_file = record.get("password_file")
    if password_file is None:
        return EtcdSecurity()
    if not isinstance(password_file, str) or record.get("user") != ROOT:
        raise ValueError("etcd.json: user and password_file are not root's")
    return EtcdSecurity(user=ROOT, password_file=password_file)


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
