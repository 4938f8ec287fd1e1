"""Placements too big for one etcd transaction (`max_txn_ops`, `max_txn_bytes`), for
the agents launcher: written ahead, committed by one key, withdrawn or swept when never
committed.

The assignments are written ahead of the job's move to STARTING, in chunks (`chunks`),
each naming the placement; the reconciler's transaction then writes only the
placement's commit key, which agents wait for before they start anything of it. A chunk
refused undoes the chunks before it. What a writer left uncommitted (it died, or gave
up) is swept by the leader after `placement_grace`, and a commit goes when its attempt
ends.
"""

from __future__ import annotations

import json
import logging
import re
import time

from coordinator.etcd.client import Etcd
from coordinator.etcd.errors import EtcdError
from coordinator.etcd.txn import CreatedAt, Delete, Empty, KeyValue, Put, ValueIs, When
from coordinator.keys import Keys, member_name, new_placement, placements_of
from coordinator.service.launchers import Launch, Reservation
from coordinator.service.model import Member
from coordinator.service.placement.chunks import Write, chunk_guards, chunks
from coordinator.service.placement.protocol import PLACEMENT_PATTERN, signed_assignment
from coordinator.signing import Signer

log = logging.getLogger(__name__)

#: Seconds a placement's assignments may wait for its commit before the leader's sweep
#: removes them: far longer than a writer takes from its first chunk to its commit.
PLACEMENT_GRACE = 30.0


class PlacementsAhead:
    def __init__(
        self,
        etcd: Etcd,
        signer: Signer,
        max_txn_ops: int,
        max_txn_bytes: int,
        placement_grace: float,
    ) -> None:
        """Placements written in transactions of at most `max_txn_ops` operations and
        `max_txn_bytes` bytes; swept once uncommitted for `placement_grace` seconds."""
        if not placement_grace > 0:
            raise ValueError("placement_grace must be a positive number of seconds")
        self.etcd = etcd
        self.signer = signer  # signs each assignment (with its placement)
        self.keys = Keys(etcd.namespace)
        self.max_txn_ops = max_txn_ops
        self.max_txn_bytes = max_txn_bytes
        self.placement_grace = placement_grace
        # placement id -> when the sweep first saw it uncommitted (monotonic)
        self._uncommitted: dict[str, float] = {}
        self._swept_at = float("-inf")

    def write(
        self,
        launch: Launch,
        placed: list[tuple[str, tuple[int, ...]]],
        assignments: list[dict[str, object]],
        members: list[Member],
        registrations: dict[str, KeyValue],
        revision: int,
    ) -> Reservation | None:
        """Write the assignments now, in chunks, naming a new placement; what the
        reconciler commits is then the placement's commit key alone (None: a chunk
        was refused, and those before it are undone)."""
        placement = new_placement(launch.run_id, launch.attempt)
        writes = []
        for index, ((agent_id, _), assignment) in enumerate(zip(placed, assignments, strict=True)):
            name = member_name(launch.run_id, launch.attempt, index)
            value = signed_assignment(self.signer, agent_id, {**assignment, "placement": placement})
            writes.append(Write(agent_id, self.keys.assignment(agent_id, name), value))
        agents = {agent_id for agent_id, _ in placed}
        registered = {
            a: CreatedAt(registrations[a].key, registrations[a].create_revision) for a in agents
        }
        prefixes = {a: self.keys.assignments(a) for a in agents}
        written_at = dict.fromkeys(agents, revision)
        written: list[Write] = []
        for chunk in chunks(writes, self.max_txn_ops, self.max_txn_bytes):
            puts = [Put(w.key, w.value, registrations[w.agent_id].lease) for w in chunk]
            guards = chunk_guards(chunk, registered, prefixes, written_at)
            try:
                result = self.etcd.transaction(puts, when=guards)
            except EtcdError as exc:  # an agent's lease gone, etcd away: try again later
                log.warning("placement %s: a chunk was not written (%s)", placement, exc)
                result = None
            if result is None or not result.succeeded:
                self._withdraw(placement, written)  # (an unanswered chunk: the sweep's)
                return None
            written += chunk
            written_at.update(dict.fromkeys({w.agent_id for w in chunk}, result.revision))
        commit = {"run_id": launch.run_id, "attempt": launch.attempt, "members": len(members)}
        put = Put(self.keys.placement(placement), json.dumps(commit))
        return Reservation(
            puts=[put], members=members, release=lambda: self._withdraw(placement, written)
        )

    def _withdraw(self, placement: str, writes: list[Write]) -> None:
        """Delete these assignments of an uncommitted placement: each only if it still
        holds what was written, and none once the placement is committed (checked in
        each transaction). Best effort: what is left, the sweep removes."""
        commit = self.keys.placement(placement)
        try:
            # Each deletion a nested transaction of one condition: one op less per chunk.
            for chunk in chunks(writes, self.max_txn_ops - 1, self.max_txn_bytes):
                ops = [When((ValueIs(w.key, "=", w.value),), (Delete(w.key),)) for w in chunk]
                result = self.etcd.transaction(ops, when=[Empty(commit, _just(commit))])
                if not result.succeeded:
                    return  # committed after all: its members are the job's
        except EtcdError as exc:
            log.warning("placement %s: not withdrawn yet (%s); the sweep will", placement, exc)

    def sweep(self) -> int:
        """Remove the assignments of placements still uncommitted `placement_grace`
        seconds after this replica first saw them so (their writer died, or gave up,
        between its chunks and its commit); how many placements were removed. Asked
        every tick of the leader; reads etcd only every few seconds."""
        now = time.monotonic()
        if now - self._swept_at < min(5.0, max(0.2, self.placement_grace / 4)):
            return 0
        self._swept_at = now
        assigned, _ = self.etcd.get_prefix(self.keys.assignments())
        committed, _ = self.etcd.get_prefix(self.keys.placements, keys_only=True)
        made = {self.keys.placement_id(kv.key) for kv in committed}
        waiting: dict[str, list[Write]] = {}
        for kv in assigned:
            placement = _placement_of(kv)
            if placement is not None and placement not in made:
                agent_id, _ = self.keys.assigned(kv.key)
                waiting.setdefault(placement, []).append(Write(agent_id, kv.key, kv.value))
        self._uncommitted = {p: self._uncommitted.get(p, now) for p in waiting}
        removed = 0
        for placement, writes in waiting.items():
            if now - self._uncommitted[placement] >= self.placement_grace:
                log.warning(
                    "placement %s: never committed; its %d assignment(s) removed",
                    placement, len(writes),
                )  # fmt: skip
                self._withdraw(placement, writes)
                removed += 1
        return removed

    def ended(self, run_id: str, attempt: int) -> None:
        """The attempt's members are gone: its placement's commit goes too."""
        self.delete_commits(placements_of(run_id, attempt))

    def delete_commits(self, which: re.Pattern[str]) -> int:
        """Delete the commits whose placement id `which` matches; how many."""
        commits, _ = self.etcd.get_prefix(self.keys.placements, keys_only=True)
        return sum(
            self.etcd.delete(kv.key)
            for kv in commits
            if which.fullmatch(self.keys.placement_id(kv.key))
        )


def _placement_of(kv: KeyValue) -> str | None:
    """The placement an assignment names, if it names a well-formed one (the assignments
    are the service's own writing, but read back, they are checked)."""
    try:
        placement = json.loads(kv.value).get("placement")
    except (ValueError, AttributeError):
        return None
    if isinstance(placement, str) and re.match(PLACEMENT_PATTERN, placement):
        return placement
    return None


def _just(key: str) -> bytes:
    """The range end that selects `key` alone."""
    return key.encode() + b"\0"
