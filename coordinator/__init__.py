"""etcd-coordinator. In a job's program: `ctx = coordinator.context()` (docs/api.md).

Names load on first use, so `import coordinator` stays cheap for every process.
"""

from __future__ import annotations

from typing import Any

_PUBLIC = {
    "context": "coordinator.context",
    "Context": "coordinator.context",
    "NotInJob": "coordinator.context",
    "RendezvousError": "coordinator.rendezvous.errors",
    "MemberLost": "coordinator.rendezvous.errors",
    "RendezvousTimeout": "coordinator.rendezvous.errors",
    "SessionLost": "coordinator.rendezvous.errors",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value
