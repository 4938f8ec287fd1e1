"""Which rows each member reads: pure planning over row counts, so every member computes the
same plan on its own without talking to the others, and so it can be tested without files.

Two modes:

* By file, when there are at least `world_size` non-empty files: each file goes whole to one
  member, so no member opens a file another member reads. Files are assigned greedily, largest
  first (ties: lower file index first), each to the member with the fewest rows so far (ties:
  fewer files, then lower rank). A member's pieces are listed in file order. Greedy
  largest-first keeps the heaviest member within 4/3 of the best possible balance.
  Empty files are left out: they hold no rows, and counting them could leave a member with only
  empty files while another has two full ones.
* By row range otherwise: the concatenation of all files, in file order, is cut into
  `world_size` contiguous ranges whose sizes differ by at most 1 (lower ranks get the extra
  rows). Concatenating the ranks' shards in rank order gives the whole data set back.

A member may get no pieces (fewer rows than members); planning allows it, loading refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Piece:
    """Rows `start` (inclusive) to `stop` (exclusive) of file number `file` of a source."""

    file: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def plan(row_counts: Sequence[int], world_size: int) -> list[list[Piece]]:
    """One list of pieces per rank; every row of every file is in exactly one piece."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if any(count < 0 for count in row_counts):
        raise ValueError(f"row counts must be >= 0, got {list(row_counts)}")
    non_empty = [index for index, count in enumerate(row_counts) if count > 0]
    if len(non_empty) >= world_size:
        return _by_file(row_counts, non_empty, world_size)
    return _by_rows(row_counts, world_size)


def by_file(row_counts: Sequence[int], world_size: int) -> bool:
    """Whether `plan` shards these counts by whole files (else by row ranges)."""
    return sum(1 for count in row_counts if count > 0) >= world_size


def _by_file(row_counts: Sequence[int], files: list[int], world_size: int) -> list[list[Piece]]:
    loads = [0] * world_size
    assigned: list[list[Piece]] = [[] for _ in range(world_size)]
    for file in sorted(files, key=lambda index: (-row_counts[index], index)):
        rank = min(range(world_size), key=lambda r: (loads[r], len(assigned[r]), r))
        loads[rank] += row_counts[file]
        assigned[rank].append(Piece(file, 0, row_counts[file]))
    return [sorted(pieces) for pieces in assigned]


def _by_rows(row_counts: Sequence[int], world_size: int) -> list[list[Piece]]:
    total = sum(row_counts)
    base, extra = divmod(total, world_size)
    result: list[list[Piece]] = []
    for rank in range(world_size):
        start = rank * base + min(rank, extra)
        stop = start + base + (1 if rank < extra else 0)
        result.append(_cut(row_counts, start, stop))
    return result


def _cut(row_counts: Sequence[int], start: int, stop: int) -> list[Piece]:
    """The pieces of rows `start`..`stop` of the concatenation of all files."""
    pieces = []
    offset = 0
    for file, count in enumerate(row_counts):
        low, high = max(start, offset), min(stop, offset + count)
        if low < high:
            pieces.append(Piece(file, low - offset, high - offset))
        offset += count
    return pieces
