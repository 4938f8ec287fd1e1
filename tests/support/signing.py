"""One signing key pair for a test session: every service the tests start signs with
it (`ServiceProc`), every agent verifies with it (`AgentProc`), and a test that writes
job records or assignments as the service would signs them with it (`session_signer`)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

from coordinator.signing import Signer, load_private_key, write_key_pair


@cache
def key_files() -> tuple[Path, Path]:
    """(private key, public key), made once per process and removed at its exit."""
    folder = Path(tempfile.mkdtemp(prefix="coordinator-signing-"))
    atexit.register(shutil.rmtree, folder, True)
    private, public = folder / "signing-key", folder / "signing-key.pub"
    write_key_pair(private, public)
    return private, public


def session_signer() -> Signer:
    return Signer(load_private_key(key_files()[0]))
