"""Bearer tokens with a role each: `read` may look, `submit` may also submit and cancel.

The token file has one `<role> <token>` per line (`#` starts a comment).
Tokens are compared in constant time, against every known token, so neither
a match nor its position leaks through timing.
"""

from __future__ import annotations

import hmac
from enum import StrEnum
from pathlib import Path


class Role(StrEnum):
    READ = "read"
    SUBMIT = "submit"


class Tokens:
    def __init__(self, tokens: dict[str, Role]) -> None:
        self._tokens = [(token.encode(), role) for token, role in tokens.items()]

    @classmethod
    def load(cls, path: Path) -> Tokens:
        tokens: dict[str, Role] = {}
        for number, raw in enumerate(path.read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or parts[0] not in Role.__members__.values():
                raise ValueError(
                    f"{path}:{number}: expected '<role> <token>' with role read or submit"
                )
            if len(parts[1]) < 16:
                raise ValueError(f"{path}:{number}: a token needs at least 16 characters")
            tokens[parts[1]] = Role(parts[0])
        if not tokens:
            raise ValueError(f"{path}: no tokens")
        return cls(tokens)

    def role(self, presented: str) -> Role | None:
        """The role of a presented token, or None; the time taken does not depend on which
        token (if any) matches."""
        given = presented.encode()
        found: Role | None = None
        for token, role in self._tokens:
            if hmac.compare_digest(given, token):
                found = role
        return found
