"""Job kinds: what a member does between `connect` and the `training` barrier."""

from __future__ import annotations

from collections.abc import Callable

from coordinator.jobs import noop
from coordinator.rendezvous.member import Member

JobFunction = Callable[[Member], dict[str, object]]

JOB_KINDS: dict[str, JobFunction] = {"noop": noop.run}
