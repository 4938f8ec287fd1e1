"""Bearer tokens with a role each: `read` may look, `submit` may also submit and cancel,
`exec` may also submit `command` jobs (any program, run as the members' user).

The token file has one `<role> <token>` per line (`#` starts a comment), is
owned by the service's user or root, and only its owner may read it (mode 0600:
one that group or others can read is refused; see `check_private` for mounted
secrets). Without a token file `coordinator serve` makes one, `api-token` in its
data directory, with one `submit` token (its operator's), and uses it again on
restart. `exec` (any program) is never generated: it takes a token file written
on purpose (--token-file); an `exec` line in the generated file counts as `submit`.
Tokens are compared in constant time, against every known token, so neither
a match nor its position leaks through timing.
"""

from __future__ import annotations

import hmac
import os
import secrets
from enum import StrEnum
from pathlib import Path

from coordinator.files import check_secret_mode

GENERATED_TOKEN_FILE = "api-token"  # in the data directory


class Role(StrEnum):
    READ = "read"
    SUBMIT = "submit"
    EXEC = "exec"

    def covers(self, needed: Role) -> bool:
        """Each role includes the ones before it: read < submit < exec."""
        order = list(Role)
        return order.index(self) >= order.index(needed)


class Tokens:
    def __init__(self, tokens: dict[str, Role]) -> None:
        self._tokens = [(token.encode(), role) for token, role in tokens.items()]

    @classmethod
    def load(cls, path: Path, served: bool = True) -> Tokens:
        """The tokens of `path`; ValueError (naming the file) for a file others may read
        or a malformed line, and (`served`: the service's own tokens) one of an owner
        other than the service's user or root, who could write themselves a token."""
        if served:
            check_owner(path)
        check_private(path)
        tokens: dict[str, Role] = {}
        for number, raw in enumerate(path.read_text().splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or parts[0] not in Role.__members__.values():
                raise ValueError(
                    f"{path}:{number}: expected '<role> <token>' with role read, submit or exec"
                )
            if len(parts[1]) < 16:
                raise ValueError(f"{path}:{number}: a token needs at least 16 characters")
            tokens[parts[1]] = Role(parts[0])
        if not tokens:
            raise ValueError(f"{path}: no tokens")
        return cls(tokens)

    def capped(self, highest: Role) -> Tokens:
        """These tokens with no role above `highest`."""
        order = list(Role)
        capped = Tokens({})
        capped._tokens = [
            (token, role if order.index(role) <= order.index(highest) else highest)
            for token, role in self._tokens
        ]
        return capped

    def strongest(self) -> str:
        """The token with the strongest role (the first of equals), for a link."""
        order = list(Role)
        best = max(self._tokens, key=lambda item: order.index(item[1]))
        return best[0].decode()

    def role(self, presented: str) -> Role | None:
        """The role of a presented token, or None; the time taken does not depend on which
        token (if any) matches."""
        given = presented.encode()
        found: Role | None = None
        for token, role in self._tokens:
            if hmac.compare_digest(given, token):
                found = role
        return found


def check_owner(path: Path) -> None:
    """Refuse a token file owned by anyone but the service's user or root: its owner may
    rewrite it, and give themselves a token of any role."""
    owner = path.stat().st_uid
    if owner not in (os.geteuid(), 0):
        raise ValueError(
            f"{path} is owned by uid {owner}; a token file must be owned by the "
            f"service's user (uid {os.geteuid()}) or root: chown {os.geteuid()} {path}"
        )


def check_private(path: Path) -> None:
    """Refuse a token file that group or others may read: the service's own file (owned by
    the user it runs as, as the generated one always is) must be 0600 or stricter. A file
    of another owner (for the service: root's, a mounted Kubernetes Secret) is readable
    only through its group or other bits: that one must not be writable by them."""
    check_secret_mode(path, path.stat(), "a token file")


def generated_tokens(data_dir: Path) -> Tokens:
    """The tokens of `<data_dir>/api-token`, made (0600, one submit token) when missing,
    else read again (a restart keeps the token its users have); never above `submit`
    (an earlier version wrote `exec` there)."""
    path = data_dir / GENERATED_TOKEN_FILE
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return Tokens.load(path).capped(Role.SUBMIT)
    with os.fdopen(descriptor, "w") as handle:
        handle.write("# made by coordinator serve: the dashboard and the CLI use it\n")
        handle.write("# (exec, for command jobs, needs a token file of your own: --token-file)\n")
        handle.write(f"submit {secrets.token_urlsafe(32)}\n")
    return Tokens.load(path).capped(Role.SUBMIT)


def add_token(path: Path, role: Role) -> str:
    """A new token of `role`, added to the token file `path` (made 0600, its folder 0700,
    when missing); ValueError naming a file group or others may read."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(descriptor, "a") as handle:
        check_private(path)
        token = secrets.token_urlsafe(32)
        handle.write(f"{role} {token}\n")
    return token


def find_token(data_dirs: list[Path]) -> str | None:
    """The strongest token of the first `api-token` found in `data_dirs` (how the CLI
    finds the token of a service on this host); ValueError naming a file found but
    open to others or malformed."""
    for folder in data_dirs:
        path = folder / GENERATED_TOKEN_FILE
        if path.is_file():  # the service's, whoever runs the CLI
            return Tokens.load(path, served=False).strongest()
    return None
