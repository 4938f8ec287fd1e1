"""What `/healthz` and `/readyz` answer, without ever waiting on etcd past a second.

- alive (`/healthz`): no etcd call of the service is wedged past its deadline
  (`Watchdog`); a plain etcd outage or an election keeps it alive, since
  restarting the service cannot bring etcd back;
- ready (`/readyz`): alive, and etcd answered a read within `BUDGET`. The read
  runs on a thread of its own; a request awaits it at most `BUDGET`, and a
  read still running from an earlier request is waited on instead of starting
  another, so wedged reads never pile up threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from coordinator.etcd.client import Etcd

#: Seconds /readyz waits for etcd's answer before it says 503 (under the 1 s a probe
#: may expect: a load balancer must stop routing to us soon).
BUDGET = 0.5


class Readiness:
    def __init__(self, etcd: Etcd, key: str, budget: float = BUDGET) -> None:
        self.etcd, self.key, self.budget = etcd, key, budget
        self._lock = threading.Lock()
        self._read: concurrent.futures.Future[object] | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="readyz")

    def alive(self) -> str | None:
        """Why the service is not alive (None: it is)."""
        return self.etcd.watchdog.stalled()

    def _reading(self) -> concurrent.futures.Future[object]:
        """The read running now, or a new one."""
        with self._lock:
            if self._read is None or self._read.done():
                self._read = self._pool.submit(self.etcd.get, self.key, self.budget)
            return self._read

    def ready(self) -> str | None:
        """Why the service is not ready (None: it is); answers within `budget` seconds."""
        if (stalled := self.alive()) is not None:
            return stalled
        try:
            self._reading().result(timeout=self.budget)
        except concurrent.futures.TimeoutError:
            return self._late()
        except Exception as exc:  # EtcdError, or a client closing under us: not ready
            return f"etcd is unavailable: {exc}"
        return None

    async def ready_async(self) -> str | None:
        """`ready` for the event loop: no thread of the request pool waits on etcd."""
        if (stalled := self.alive()) is not None:
            return stalled
        read = asyncio.shield(asyncio.wrap_future(self._reading()))
        try:
            await asyncio.wait_for(read, self.budget)
        except TimeoutError:
            return self._late()
        except Exception as exc:  # EtcdError, or a client closing under us: not ready
            return f"etcd is unavailable: {exc}"
        return None

    def _late(self) -> str:
        return f"etcd did not answer a read within {self.budget:g}s"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
