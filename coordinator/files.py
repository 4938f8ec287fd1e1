"""Files written whole or not at all: a reader (a restarted service, a resuming job,
a user) never finds half a file under the final name."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path: Path, suffix: str = "") -> Iterator[Path]:
    """A temporary path beside `path` to write; it replaces `path` when the block ends
    without error, and is removed when it fails. `suffix` keeps an extension the writer
    reads (XGBoost picks its format from it)."""
    partial = path.with_name(f".{path.name}.partial{suffix}")
    try:
        yield partial
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def write_private(path: Path, text: str) -> None:
    """`text` into `path`, whole, readable by its owner only (0600 whatever the umask or
    an older file's mode)."""
    with replacing(path) as partial:
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as file:
            os.fchmod(file.fileno(), 0o600)
            file.write(text)


def check_secret_mode(path: Path, info: os.stat_result, what: str) -> None:
    """Refuse a secret file (a token file, a signing key) others may read or write:
    our own file must be 0600 or stricter; another owner's (a mounted Kubernetes or
    compose secret, read through its group or other bits) writable by no one else.
    ValueError names the file, its mode and the fix."""
    mode = stat.S_IMODE(info.st_mode)
    own = info.st_uid == os.geteuid()
    if (own and mode & 0o077) or mode & 0o022:
        raise ValueError(
            f"{path} is open to group or others: mode {mode:04o}: "
            f"{what} must be private: chmod 600 {path}"
        )
