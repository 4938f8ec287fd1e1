"""Where a job's members go on the agents: gang placement, pure (no I/O).

All of a job's members are placed, or none: a job placed in part would hold
slots while it waits for the rest, and two such jobs can wait on each other
forever. Each member goes to the matching agent with the most free slots (ties
by id), so a job's members spread over hosts instead of sharing one host's
cores. An agent matches when it carries every label the job asks for.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AgentRoom:
    id: str
    slots: int
    used: int = 0  # members assigned to it and not yet ended
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return max(0, self.slots - self.used)


def matches(agent: AgentRoom, wanted: dict[str, str]) -> bool:
    return all(agent.labels.get(key) == value for key, value in wanted.items())


def capacity(agents: list[AgentRoom], wanted: dict[str, str]) -> int:
    """The most members a job with these labels could ever get at once (all slots free)."""
    return sum(agent.slots for agent in agents if matches(agent, wanted))


def place(agents: list[AgentRoom], workers: int, wanted: dict[str, str]) -> list[str] | None:
    """The agent of each member (index 0..workers-1), or None when they do not all fit."""
    free = {agent.id: agent.free for agent in agents if matches(agent, wanted)}
    if sum(free.values()) < workers:
        return None
    chosen = []
    for _ in range(workers):
        best = min(free, key=lambda agent_id: (-free[agent_id], agent_id))
        free[best] -= 1
        chosen.append(best)
    return chosen
