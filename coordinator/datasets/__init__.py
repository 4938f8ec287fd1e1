"""Data sets for distributed training: each member loads only its own row shard.

`parse_source` turns a string (synthetic spec, builtin name, or file path/glob) into a
`DataSource`; `shards.plan` decides, from row counts alone, which rows each rank gets; and
`load_shard` reads just those rows. Members plan independently and arrive at the same plan, so
no coordination is needed beyond agreeing on the source, rank and world size.
"""

from coordinator.datasets.file_formats import Layout
from coordinator.datasets.load import (
    EmptyShard,
    Shard,
    check_shards,
    digest,
    load_all,
    load_shard,
)
from coordinator.datasets.shards import Piece, plan
from coordinator.datasets.source import BUILTINS, DataSource, parse_source

__all__ = [
    "BUILTINS",
    "DataSource",
    "EmptyShard",
    "Layout",
    "Piece",
    "Shard",
    "check_shards",
    "digest",
    "load_all",
    "load_shard",
    "parse_source",
    "plan",
]
