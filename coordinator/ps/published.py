"""A parameter server's published weights and the buffers an update may write.

Published weights are never written again, so a pull can send them without a copy and
without the server's lock while updates go on; this pool says which buffer is free.
"""

from __future__ import annotations

import torch


class PublishedWeights:
    """The published weights and the buffers an update may write (used under the lock).

    A buffer being sent to a trainer is borrowed; an update writes only a buffer
    that is neither published nor borrowed, so the pool holds at most one buffer
    per connection plus two (under `dc`, which also keeps each trainer's last pull
    borrowed, one more per trainer).
    """

    def __init__(self, weights: torch.Tensor) -> None:
        self.current = weights
        self._free: list[torch.Tensor] = []
        self._borrowers: dict[int, int] = {}  # id(buffer) -> pulls sending it

    def borrow(self) -> torch.Tensor:
        key = id(self.current)
        self._borrowers[key] = self._borrowers.get(key, 0) + 1
        return self.current

    def borrow_again(self, buffer: torch.Tensor) -> None:
        """One more borrower of a buffer still borrowed (KeyError if it is not)."""
        self._borrowers[id(buffer)] += 1

    def give_back(self, buffer: torch.Tensor) -> None:
        key = id(buffer)
        self._borrowers[key] -= 1
        if not self._borrowers[key]:
            del self._borrowers[key]
            if buffer is not self.current:
                self._free.append(buffer)

    def writable(self) -> torch.Tensor:
        return self._free.pop() if self._free else torch.empty_like(self.current)

    def publish(self, buffer: torch.Tensor) -> None:
        old, self.current = self.current, buffer
        if id(old) not in self._borrowers:
            self._free.append(old)
