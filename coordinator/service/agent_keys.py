"""The keys agents and the service's `agents` launcher share, under `<ns>/`.

- `agents/<id>`: `{slots, labels, address, version, pid, host}`, bound to the
  agent's lease; created only if absent, so two live agents never share an id.
- `assignments/<id>/<member>`: a member the service placed on that agent
  (`{run_id, attempt, index, worker_args}`, and `stop` once the service wants
  it stopped), bound to the agent's lease. The agent deletes it when the member
  ends, so the assignments under an agent are its slots in use.
- `members/<member>`: `{agent, pid, state, exit_code, at}`, the member as its agent
  saw it last (`running`, then `exited`), bound to the agent's lease. Written
  together with the assignment's deletion, so one of the two always exists
  while the agent lives.

`<member>` is `<run_id>-a<attempt>-m<index>`: unique to one member of one attempt.
"""

from __future__ import annotations

from coordinator.etcd.client import Etcd


def member_name(run_id: str, attempt: int, index: int) -> str:
    return f"{run_id}-a{attempt}-m{index}"


def agent_key(etcd: Etcd, agent_id: str) -> str:
    return etcd.key("agents", agent_id)


def assignments_prefix(etcd: Etcd, agent_id: str | None = None) -> str:
    """Every agent's assignments, or one agent's."""
    return etcd.key("assignments", agent_id) + "/" if agent_id else etcd.key("assignments") + "/"


def assignment_key(etcd: Etcd, agent_id: str, member: str) -> str:
    return assignments_prefix(etcd, agent_id) + member


def report_key(etcd: Etcd, member: str) -> str:
    return etcd.key("members", member)
