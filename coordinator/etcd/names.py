"""Names that become one segment of an etcd key (job, agent and barrier names).

One pattern for all of them: no `/`, so a name can never reach into another
party's prefix, and nothing a shell or a file system would read specially.
"""

from __future__ import annotations

import re

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(kind: str, value: str) -> str:
    """`value`, if it is a valid name; else a ValueError naming `kind`."""
    if not NAME_PATTERN.match(value):
        raise ValueError(
            f"{kind} {value!r} must be 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value
