"""Job kinds: what a member does between `connect` and the `training` barrier."""

from __future__ import annotations

from collections.abc import Callable

from coordinator.jobs import noop, steps
from coordinator.rendezvous.member import Member

#: A job gets its member (rank, roster, barriers) and its parameters, and returns
#: a small JSON-able summary. It raises ValueError for a bad parameter.
JobFunction = Callable[[Member, dict[str, str]], dict[str, object]]


def parse_params(items: list[str]) -> dict[str, str]:
    """`["a=1", "b=x"]` (from repeated --param, or one comma-separated string) to a dict."""
    params = {}
    for item in (part.strip() for entry in items for part in entry.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"job parameter {item!r} is not KEY=VALUE")
        params[key.strip()] = value.strip()
    return params


JOB_KINDS: dict[str, JobFunction] = {"noop": noop.run, "steps": steps.run}
