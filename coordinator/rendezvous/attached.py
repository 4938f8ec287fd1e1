"""A member's program joining its member's rendezvous round, for barriers of its own.

A `command` job's program is a process apart from its member. To use the
member's named barriers and step barriers it needs what a `Member` has after
`connect`: the rank, the round, a lease for its keys and a watch on the other
members' keys. `AttachedMember` is a `Member` built from those (the program's
environment gives them) instead of from an election, so the barrier and
loss-detection code is the member's own:

- Its keys are bound to the member's lease (COORDINATOR_LEASE), which the
  member keeps alive: they outlive a program that finished early (a finished
  step worker must stay `done` for the others) and vanish with the member.
  The program never renews or revokes that lease.
- A peer is lost when its member key vanishes: a killed member's lease ends
  within a TTL; a crashed program fails its member, which then leaves.
- Its barriers live apart from the member's own (`rendezvous/program/barriers/`:
  `coordinator.keys.ProgramKeys`), so a program's `training` is not the member's.
"""

from __future__ import annotations

from coordinator.etcd.client import Etcd
from coordinator.etcd.session import LeaseHolder
from coordinator.etcd.values import json_object
from coordinator.etcd.watch import WatchEvent
from coordinator.keys import ProgramKeys, rank_of
from coordinator.rendezvous.errors import MemberLost, RendezvousError
from coordinator.rendezvous.member import Member, loss_reason
from coordinator.rendezvous.roster import Roster


class BorrowedLease(LeaseHolder):
    """The member's lease, as a `Session` looks to `Member`: used, never renewed or revoked."""

    def close(self, revoke: bool = False) -> None:
        """Nothing to do: the lease is the member's."""


class AttachedMember(Member):
    """A program's view of its member after `connect` (see the module docstring)."""

    def __init__(
        self,
        etcd: Etcd,
        job_id: str,
        world_size: int,
        *,
        rank: int,
        round_: int,
        lease_id: int,
        timeout: float = 300.0,
    ) -> None:
        super().__init__(
            etcd, job_id, world_size, timeout=timeout, member_id=f"program-{job_id}-{rank}"
        )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        self.keys = ProgramKeys(etcd.namespace, job_id)
        self.rank = rank
        self.round = round_
        self.phase = "program"
        self._borrowed = BorrowedLease(lease_id)
        self._session = self._borrowed  # type: ignore[assignment]

    def attach(self) -> AttachedMember:
        """Check that every member of the round is there, then watch for their loss."""
        members, revision = self.etcd.get_prefix(self.keys.members)
        present = {rank_of(kv.key) for kv in members}
        if self.rank not in present:
            raise RendezvousError(
                f"this program's member (rank {self.rank}) is not in job '{self.job_id}' "
                "any more: it left or its lease ended"
            )
        missing = sorted(set(range(self.world_size)) - present)
        if missing and not self._tolerate_loss:
            raise MemberLost(missing[0], self.phase, loss_reason({}))
        self._excused.update(missing)
        self._liveness = self.etcd.watch(
            self.keys.members,
            self._on_member_deleted,
            start_revision=revision + 1,
            prefix=True,
            only_deletes=True,
        )
        return self

    def _on_member_deleted(self, events: list[WatchEvent]) -> None:
        for event in events:
            if rank_of(event.key) == self.rank:
                self._borrowed.mark_lost(
                    f"this program's member left: {loss_reason(json_object(event.prev_value))}"
                )
        super()._on_member_deleted(events)

    def _require_roster(self) -> Roster:
        """The program has no roster object (the file leaves the secret out); none is needed."""
        return self.roster  # type: ignore[return-value]

    def close(self, error: BaseException | None = None) -> None:
        """Stop watching; the keys stay with the member's lease (see the module docstring)."""
        self._stop_liveness()
