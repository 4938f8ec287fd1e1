"""Child processes that cannot outlive the one that started them.

A process we start and stop ourselves (a member, the embedded etcd) would be orphaned
if we were SIGKILLed, with nobody left to stop it. `die_with_parent(argv)` is argv run
by a short prelude that asks the kernel for SIGKILL when the thread that started it
ends (prctl PR_SET_PDEATHSIG = 1, kept across exec), leaves if that parent is already
gone, then becomes `argv`. A fresh interpreter does this, not code run between fork
and exec: there it would share the parent's gRPC state, whose fork handlers abort the
child now and then. Linux only, as the product is.
"""

from __future__ import annotations

import os
import sys

_PRELUDE = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def die_with_parent(argv: list[str]) -> list[str]:
    """`argv` (argv[0] a path), killed when the thread that starts it ends."""
    return [sys.executable, "-c", _PRELUDE, str(os.getpid()), *argv]
