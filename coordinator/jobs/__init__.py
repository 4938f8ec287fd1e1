"""Job kinds: what a member does between `connect` and the `training` barrier."""

from __future__ import annotations

from collections.abc import Callable

from coordinator.jobs import noop, steps
from coordinator.rendezvous.member import Member

#: A job gets its member (rank, roster, barriers) and its parameters, and returns
#: a small JSON-able summary. It raises ValueError for a bad parameter.
JobFunction = Callable[[Member, dict[str, str]], dict[str, object]]


JOB_KINDS: dict[str, JobFunction] = {"noop": noop.run, "steps": steps.run}
