"""The cap on a job's thread and process counts (`cap = "threads"` in catalog.toml).

A member's OpenMP or PyTorch pool takes as many threads as it is told: a `submit`
token asking `threads=1000000` once took every thread the host allows, and the
embedded etcd died with it. So every parameter the catalog marks as a thread count
is at most a cap: `serve --max-threads` (exported to the members as
$COORDINATOR_MAX_THREADS), else the host's cores. The service checks at submit,
`coordinator run` before it starts anything, and each member again before it builds
its job (a record may reach etcd by other paths).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from coordinator.field_error import FieldError
from coordinator.jobs.catalog import Param

MAX_THREADS_ENV = "COORDINATOR_MAX_THREADS"


def host_cores() -> int:
    """The cores this process may run on (its affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def thread_cap(environ: Mapping[str, str] | None = None) -> int:
    """$COORDINATOR_MAX_THREADS where it is set (ValueError naming it when it is not a
    whole number of at least 1), else the host's cores."""
    text = (os.environ if environ is None else environ).get(MAX_THREADS_ENV, "").strip()
    if not text:
        return host_cores()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"${MAX_THREADS_ENV}={text[:40]!r} is not a whole number of at least 1")
    return int(text)


def check_thread_caps(
    kind: str, catalog: tuple[Param, ...], params: Mapping[str, str], cap: int
) -> None:
    """Refuse (a FieldError naming `params.<name>` and the cap) a thread count above
    `cap`. A value that is not a whole number is left to the kind's own check, which
    names it better."""
    for param in catalog:
        if param.cap != "threads" or param.name not in params:
            continue
        text = params[param.name].strip()
        try:
            value = int(text)
        except ValueError:
            continue
        if value > cap:
            raise FieldError(
                f"params.{param.name}",
                f"{kind} job: parameter {param.name}={text[:40]} is above the cap of {cap} "
                f"threads per member here (--max-threads of serve or agent, else the host's cores)",
            )
