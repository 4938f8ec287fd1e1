"""Data sets for distributed training: each member loads only its own row shard.

`parse_source` turns a string (synthetic spec, builtin name, or file path/glob) into a
`DataSource`; `shards.plan` decides, from row counts alone, which rows each rank gets; and
`load_shard` reads just those rows. Members plan independently and arrive at the same plan, so
no coordination is needed beyond agreeing on the source, rank and world size.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Where each public name lives. They are imported on first use (PEP 562): numpy and scipy
#: cost a process about half a second to import, and most importers of this package (a
#: member checking its parameters, the service admitting a job) need neither.
_HOMES = {
    "Layout": "file_formats",
    "EmptyShard": "load",
    "Shard": "load",
    "check_shards": "load",
    "digest": "load",
    "load_all": "load",
    "load_shard": "load",
    "Piece": "shards",
    "plan": "shards",
    "BUILTINS": "source",
    "DataSource": "source",
    "parse_source": "source",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


__all__ = sorted(_HOMES)
