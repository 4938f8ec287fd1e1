"""The service's own etcd when none is given: one per data directory, outliving the service.

Members keep talking to etcd while the service restarts, so this etcd must not
die with it: it runs in a session of its own, and `<data>/etcd.json` records its
pid, start time and port. A service started again on the same directory finds
it there and uses it; only when none runs is a new one started (on the same
data, so every job record is still there).
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from coordinator.etcd.server import EmbeddedEtcd


class ServiceEtcd:
    def __init__(self, data_dir: Path) -> None:
        self.state = data_dir / "etcd.json"
        self.server: EmbeddedEtcd | None = None
        running = self._running()
        if running is not None:
            self.endpoint = running
            return
        data_dir.mkdir(parents=True, exist_ok=True)
        self.server = EmbeddedEtcd(data_dir / "etcd").start()
        assert self.server.process is not None
        pid = self.server.process.pid
        record = {"pid": pid, "started": psutil.Process(pid).create_time()}
        record["endpoint"] = self.endpoint = self.server.endpoint
        partial = self.state.with_suffix(".partial")
        partial.write_text(json.dumps(record))
        partial.replace(self.state)

    def _running(self) -> str | None:
        try:
            record = json.loads(self.state.read_text())
            process = psutil.Process(record["pid"])
            if abs(process.create_time() - record["started"]) < 0.05 and process.is_running():
                return str(record["endpoint"])
        except (OSError, ValueError, KeyError, psutil.NoSuchProcess):
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
