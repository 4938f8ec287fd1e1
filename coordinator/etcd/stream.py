"""The library's watch stream, made safe to end and to replace (see `WatchStream`)."""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import grpc
from pyetcd import etcdrpc
from pyetcd.watch import Watcher

log = logging.getLogger(__name__)


class WatchStream(Watcher):
    """The library's watch stream, ended at once when the client moves away from its
    connection (`close` cancels the stream: the connection itself stays open a while, see
    RETIRE_SECONDS), and quiet when a stream starts on a closed connection (ValueError in
    the library's thread, where gRPC errors are caught). Either way the library has told
    the callbacks the stream ended, so the watches resume on the next member."""

    def __init__(self, stub: etcdrpc.WatchStub, timeout: float, metadata: Any) -> None:
        super().__init__(_RecordingStub(stub, self), timeout=timeout, metadata=metadata)
        self.stub, self.metadata = stub, metadata
        # The stream running now, weakly: a strong reference would keep it for the
        # interpreter's last collection, whose `__del__` of it then waits for ever on a
        # lock that the (frozen) daemon thread reading it holds: the program never exits.
        self.stream: weakref.ref[grpc.Future] | None = None

    # The library bounds its request queue at 10 and puts into it under its lock. Once a
    # stream stops reading its requests (cancelled, or stuck), the 11th put (a watch's
    # cancel, say) waits for ever holding that lock, and so does all that needs it: the
    # stream's own ending, every other watch, a keepalive moving to another member. So
    # the queue the library sets is replaced by an unbounded one, where a put never waits.
    @property
    def _request_queue(self) -> queue.Queue[Any]:
        return self._requests

    @_request_queue.setter
    def _request_queue(self, bounded: queue.Queue[Any]) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()

    def cancel_watch(self, watch_id: int, callback: Callable[[Any], None]) -> None:
        """End watch `watch_id` if it is still `callback`'s. Ids count from 0 on every
        stream, this one's next too: once the stream a watch was created on has ended,
        its id may be another watch's (which would never hear of its keys again)."""
        with self._lock:
            if self._callbacks.get(watch_id) is not callback:
                return
            del self._callbacks[watch_id]
            self._cancel_no_lock(watch_id)

    def join(self, timeout: float) -> None:
        """Wait for the stream's thread to end (not from the thread itself)."""
        thread = self._callback_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        try:
            super()._run()  # type: ignore[misc]
        except ValueError as exc:
            log.debug("watch stream on a closed connection: %s", exc)

    def close(self) -> None:
        """End the stream at once: the library's close only queues an end marker, which
        a stuck stream would never read."""
        stream = self.stream() if self.stream is not None else None
        if stream is not None:
            stream.cancel()
        super().close()


class _RecordingStub:
    """A watch stub that hands each stream it opens to its watcher (to cancel it)."""

    def __init__(self, stub: etcdrpc.WatchStub, watcher: WatchStream) -> None:
        self._stub, self._watcher = stub, watcher

    def Watch(self, *args: Any, **kwargs: Any) -> Any:  # (the stub method's name)
        stream = self._stub.Watch(*args, **kwargs)
        self._watcher.stream = weakref.ref(stream)
        return stream
