"""Members' output read on threads of their own, so that no member's output server can
hold up the reconciler: a read that is slow (an agent far away, or one that drips a
byte at a time) delays only its own member's following.

The reconciler asks for a member's output from an offset; a read of it is started on
the pool and waited on for `QUICK` seconds (a local file answers well within). A read
not done by then is left running and its result taken at a later tick; meanwhile
`read` says None (nothing new of the member this tick).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

#: Which member a read is of: (job, attempt, index).
MemberKey = tuple[str, int, int]

#: Seconds the reconciler waits for a read it just started.
QUICK = 0.05
#: Reads at once: slow ones each end within their launcher's own deadline.
WORKERS = 16


class OutputReads:
    def __init__(self, quick: float = QUICK, workers: int = WORKERS) -> None:
        self.quick = quick
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="output")
        self._lock = threading.Lock()
        # (member, offset) -> the read of its output from that offset
        self._reads: dict[tuple[MemberKey, int], concurrent.futures.Future[bytes]] = {}

    def read(self, member: MemberKey, offset: int, read: Callable[[], bytes]) -> bytes | None:
        """What `read` gives for `member` from `offset` if it is ready now (or within
        `quick` of starting); None while it runs. A failed read gives b"" (asked again)."""
        key = (member, offset)
        with self._lock:
            future = self._reads.get(key)
            fresh = future is None
            if future is None:
                future = self._pool.submit(read)
                self._reads[key] = future
        try:
            chunk = future.result(timeout=self.quick if fresh else 0)
        except concurrent.futures.TimeoutError:
            return None
        except Exception:
            chunk = b""
        with self._lock:
            self._reads.pop(key, None)
        return chunk

    def forget(self, is_gone: Callable[[MemberKey], bool]) -> None:
        """Drop the reads of members `is_gone` names (a read still running ends alone)."""
        with self._lock:
            for key in [k for k in self._reads if is_gone(k[0])]:
                del self._reads[key]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
