"""Parameter-server training: the wire format, the server, the trainer's client, the model.

Tensors never go through etcd (too big) and never as pickles (unpickling what a
peer sends runs its code): they travel as raw float32 bytes over TCP between a
member's roster endpoint and the trainers, framed by `wire`.

The public API is `coordinator.ps.api`, re-exported here: `serve`, `trainer`,
`reader`, `optimizer`, `Peers`, `ServerAddress`, `program_peers` (imported on
first use).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "OptimizerSpec",
    "Peers",
    "ProgramPeers",
    "Server",
    "ServerAddress",
    "Trainer",
    "optimizer",
    "program_peers",
    "reader",
    "serve",
    "trainer",
]


def __getattr__(name: str) -> Any:
    """The API, imported on first use: `coordinator.ps.wire` alone needs no torch."""
    if name in __all__:
        from coordinator.ps import api

        return getattr(api, name)
    raise AttributeError(f"module 'coordinator.ps' has no attribute {name!r}")
