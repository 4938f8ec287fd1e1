"""Where a job's members go on the agents: gang placement, pure (no I/O).

All of a job's members are placed, or none: a job placed in part would hold
slots while it waits for the rest, and two such jobs can wait on each other
forever. Each member goes to the matching agent with the most free slots (ties
by id), so a job's members spread over hosts instead of sharing one host's
cores. An agent matches when it carries every label the job asks for.

A job that asks for GPUs (`gpus_per_worker`) gets whole GPUs of the ids its
agents declared, never one another member on that agent holds: a member needs a
free slot and that many free GPUs on its agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AgentRoom:
    id: str
    slots: int
    used: int = 0  # members assigned to it and not yet ended
    labels: dict[str, str] = field(default_factory=dict)
    gpus: tuple[int, ...] = ()  # the GPU ids it declared
    gpus_used: frozenset[int] = frozenset()  # those its assigned members hold

    @property
    def free(self) -> int:
        return max(0, self.slots - self.used)

    def free_gpus(self) -> list[int]:
        return sorted(set(self.gpus) - self.gpus_used)

    def room(self, gpus_per_worker: int) -> int:
        """How many more members of a job with `gpus_per_worker` fit here now."""
        if gpus_per_worker <= 0:
            return self.free
        return min(self.free, len(self.free_gpus()) // gpus_per_worker)


def matches(agent: AgentRoom, wanted: dict[str, str]) -> bool:
    return all(agent.labels.get(key) == value for key, value in wanted.items())


def capacity(agents: list[AgentRoom], wanted: dict[str, str], gpus_per_worker: int = 0) -> int:
    """The most members a job with these labels (and GPUs per member) could ever get at
    once (all slots and GPUs free)."""
    empty = (AgentRoom(a.id, a.slots, 0, a.labels, a.gpus) for a in agents if matches(a, wanted))
    return sum(agent.room(gpus_per_worker) for agent in empty)


def place(
    agents: list[AgentRoom], workers: int, wanted: dict[str, str], gpus_per_worker: int = 0
) -> list[tuple[str, tuple[int, ...]]] | None:
    """The agent of each member (index 0..workers-1) and the GPU ids it gets, or None
    when they do not all fit."""
    matching = [agent for agent in agents if matches(agent, wanted)]
    free = {agent.id: agent.room(gpus_per_worker) for agent in matching}
    if sum(free.values()) < workers:
        return None
    gpus = {agent.id: agent.free_gpus() for agent in matching}
    chosen = []
    for _ in range(workers):
        best = min(free, key=lambda agent_id: (-free[agent_id], agent_id))
        free[best] -= 1
        taken = gpus[best][:gpus_per_worker] if gpus_per_worker > 0 else []
        del gpus[best][: len(taken)]
        chosen.append((best, tuple(taken)))
    return chosen
