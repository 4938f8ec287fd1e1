"""Where a reader is in each member's output: whole lines only, at most `OUTPUT_CAP`
bytes a read.

The reconciler, the logs stream and the dashboard's live stream each follow members'
output from an offset. Each keeps an `OutputCursor`: a read from the cursor's offset
gives back its whole lines and moves the cursor past them; a partial last line waits
for its end. A launcher answers at most `OUTPUT_CAP` bytes a read, so a member that
printed gigabytes costs a reader no more than that a read; a line longer than a whole
read can never end inside one, and is passed over (no event is that long).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from coordinator.service.launchers import OUTPUT_CAP

Key = TypeVar("Key", bound=Hashable)


class OutputCursor(Generic[Key]):
    def __init__(self) -> None:
        self._offsets: dict[Key, int] = {}
        self._passing: set[Key] = set()  # inside a line too long to read: until its end

    def offset(self, key: Key) -> int:
        return self._offsets.get(key, 0)

    def advance(self, key: Key, chunk: bytes) -> bytes:
        """The whole lines of `chunk` (read from `offset(key)`), the cursor moved past them."""
        start = 0
        if key in self._passing:  # the rest of a line passed over, up to its end
            end = chunk.find(b"\n")
            if end < 0:
                self._offsets[key] = self.offset(key) + len(chunk)
                return b""
            self._passing.discard(key)
            start = end + 1
        last = chunk.rfind(b"\n") + 1
        if last <= start and len(chunk) >= OUTPUT_CAP:  # a line longer than any read
            self._passing.add(key)
            self._offsets[key] = self.offset(key) + len(chunk)
            return b""
        self._offsets[key] = self.offset(key) + max(last, start)
        return chunk[start:last]

    def read(self, key: Key, read: Callable[[int], bytes]) -> bytes:
        """The whole lines `read` (of an offset) gives from the cursor on, up to the end of
        what there is now: read after read while each came back full."""
        lines = []
        while True:
            chunk = read(self.offset(key))
            lines.append(self.advance(key, chunk))
            if len(chunk) < OUTPUT_CAP:
                return b"".join(lines)

    def forget(self, gone: Callable[[Key], bool]) -> None:
        for key in [k for k in self._offsets if gone(k)]:
            del self._offsets[key]
            self._passing.discard(key)
