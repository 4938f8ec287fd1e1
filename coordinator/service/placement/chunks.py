"""A placement too big for one etcd transaction, cut into transactions etcd takes (pure).

etcd refuses a transaction with more than `--max-txn-ops` operations (128 by default)
in its conditions or in its writes, and a request over `--max-request-bytes` (1.5 MiB).
A placement writes one assignment per member and guards each agent it uses twice (its
registration, and its assignments unwritten since they were read), and the
reconciler's STARTING transaction adds its own writes and conditions. A placement
that fits stays one transaction, so a job is placed whole or not at all.

One that does not is written ahead in chunks, each one transaction within the limits:
its assignments grouped by agent, each chunk guarded by the registration of every
agent it writes to and by that agent's assignments, unwritten since this writer last
wrote them (the read, then its own previous chunk): so nobody over-fills an agent in
between. The assignments name their placement, and agents start them only once its
commit exists, which the STARTING transaction writes. So it is still whole or nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.etcd.txn import CreatedAt, Guard, QuietSince

#: What the reconciler's STARTING transaction adds to a reservation: its writes (the
#: job's record, the members' credentials) and its conditions (the record unchanged,
#: the leader's fence).
STARTING_OPS = 2
STARTING_COMPARES = 2
GUARDS_PER_AGENT = 2  # its registration, its assignments
#: A safe default below etcd's 128, and the least that still leaves a chunk room.
DEFAULT_MAX_TXN_OPS = 100
MIN_TXN_OPS = STARTING_OPS + GUARDS_PER_AGENT
#: Below etcd's default `--max-request-bytes` (1.5 MiB), with room for the rest.
DEFAULT_MAX_TXN_BYTES = 1_000_000


@dataclass(frozen=True)
class Write:
    """One assignment to write: its agent, its key and its value."""

    agent_id: str
    key: str
    value: bytes

    @property
    def size(self) -> int:
        return len(self.key.encode()) + len(self.value)


def check_limits(max_txn_ops: int, max_txn_bytes: int) -> None:
    """Refuse limits no placement could be written within, naming the field."""
    if not isinstance(max_txn_ops, int) or max_txn_ops < MIN_TXN_OPS:
        raise ValueError(f"max_txn_ops must be a whole number of at least {MIN_TXN_OPS}")
    if not isinstance(max_txn_bytes, int) or max_txn_bytes < 1:
        raise ValueError("max_txn_bytes must be a positive whole number")


def fits_one_transaction(writes: Sequence[Write], max_txn_ops: int, max_txn_bytes: int) -> bool:
    """Whether the writes, with their guards and the STARTING transaction's own, fit
    one transaction."""
    agents = {write.agent_id for write in writes}
    return (
        len(writes) + STARTING_OPS <= max_txn_ops
        and GUARDS_PER_AGENT * len(agents) + STARTING_COMPARES <= max_txn_ops
        and sum(write.size for write in writes) <= max_txn_bytes
    )


def chunks(writes: Sequence[Write], max_txn_ops: int, max_txn_bytes: int) -> list[list[Write]]:
    """The writes grouped by agent (by id, each agent's in the order given), cut into
    chunks of at most `max_txn_ops` writes over agents whose guards fit `max_txn_ops`
    too, and at most `max_txn_bytes` (a single bigger write goes alone)."""
    most_agents = max(1, max_txn_ops // GUARDS_PER_AGENT)
    cut: list[list[Write]] = []
    current: list[Write] = []
    agents: set[str] = set()
    size = 0
    for write in sorted(writes, key=lambda w: w.agent_id):  # stable: members stay in order
        another_agent = write.agent_id not in agents
        if current and (
            len(current) >= max_txn_ops
            or (another_agent and len(agents) >= most_agents)
            or size + write.size > max_txn_bytes
        ):
            cut.append(current)
            current, agents, size = [], set(), 0
        current.append(write)
        agents.add(write.agent_id)
        size += write.size
    if current:
        cut.append(current)
    return cut


def chunk_guards(
    chunk: Sequence[Write],
    registrations: Mapping[str, CreatedAt],
    assignments: Mapping[str, str],
    written_at: Mapping[str, int],
) -> list[Guard]:
    """What must hold for a chunk: every agent it writes to is still the registration
    read (`registrations`), and nobody wrote under its assignments prefix
    (`assignments`) since `written_at` (the read's revision, then that of this
    writer's last chunk to the agent)."""
    guards: list[Guard] = []
    for agent_id in sorted({write.agent_id for write in chunk}):
        guards.append(registrations[agent_id])
        guards.append(QuietSince(assignments[agent_id], written_at[agent_id]))
    return guards
