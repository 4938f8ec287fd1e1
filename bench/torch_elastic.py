"""Baseline: how long PyTorch elastic (torchrun) takes to rendezvous n members.

The benchmark compares our etcd rendezvous against the rendezvous that torchrun
ships with, so this module measures torch's own code paths, unmodified and with
torch's defaults, on this machine:

* ``measure_c10d``: the ``c10d`` backend (torchrun's default), i.e.
  ``C10dRendezvousBackend`` over a ``TCPStore`` driven by
  ``DynamicRendezvousHandler``.
* ``measure_etcd_v2``: the backend the registry calls ``etcd-v2``, i.e.
  ``EtcdRendezvousBackend`` (python-etcd, etcd v2 API) driven by the same
  ``DynamicRendezvousHandler``.
* ``measure_etcd_legacy``: the registry's ``etcd`` backend, the older
  ``etcd_rendezvous.EtcdRendezvousHandler`` (also python-etcd, etcd v2 API).

Members are threads of this process, each with its own handler and its own
store/etcd client, as separate agents would have.  They are released together
by a barrier; the time runs from that release until the last member's
``next_rendezvous()`` returns.  Setup (connecting clients, building handlers)
is outside the timed part, and so is teardown.

Only loopback (127.0.0.1) is ever contacted.  torch is imported lazily, so the
module imports without it.  Run standalone: ``python bench/torch_elastic.py``.
"""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"
SIZES: tuple[int, ...] = (16, 64, 128, 256)


def _free_port() -> int:
    """Ask the kernel for an unused loopback port (etcd needs a number up front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _params(backend: str, endpoint: str, n: int, timeout_s: float, **config: Any) -> Any:
    """Build torchrun-style parameters with min_nodes == max_nodes == n.

    ``local_addr`` is pinned to loopback because otherwise torch uses
    ``socket.getfqdn()`` as the node address and publishes it as MASTER_ADDR.
    With min == max the rendezvous completes the moment the n-th node joins
    (``_add_to_participants`` marks it complete and clears the last-call
    deadline), so the default ``last_call_timeout`` (30 s) never applies.
    """
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    return RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=f"bench-{uuid.uuid4().hex[:12]}",
        min_nodes=n,
        max_nodes=n,
        local_addr=LOOPBACK,
        **config,
    )


def _create_handlers(params: Any, n: int) -> list[Any]:
    """One handler per member, created through torchrun's registry, as an agent does."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    return [rendezvous_handler_registry.create_handler(params) for _ in range(n)]


# Extra wait past torch's own join timeout (set to timeout_s), so that members
# give up by themselves (rollback window 5 s, 1 s poll, store reads) and are all
# gone before the store is torn down; otherwise every live TCPStore client logs
# a C++ traceback when the server vanishes under it.
_GRACE_S = 30.0


def _race(handlers: Sequence[Any], timeout_s: float) -> float:
    """Release every member at once; return seconds until the last one holds the rendezvous.

    The barrier's action stamps the start in the last thread to arrive, just
    before all are let go, so thread start-up is not counted.  The result is
    checked: ranks must be exactly 0..n-1 and every world size n.  Raises
    TimeoutError if torch's join timeout (``timeout_s``) expired first.
    """
    n = len(handlers)
    start: list[float] = []
    ends = [0.0] * n
    ranks: list[tuple[int, int] | None] = [None] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n, action=lambda: start.append(time.monotonic()))

    def member(i: int) -> None:
        try:
            barrier.wait(timeout_s)
            info = handlers[i].next_rendezvous()
            ends[i] = time.monotonic()
            ranks[i] = (info.rank, info.world_size)
        except BaseException as exc:  # reported to the caller below
            errors.append(exc)
            barrier.abort()

    # Daemon threads: a member stuck past the deadline must not keep the process alive.
    threads = [
        threading.Thread(target=member, args=(i,), name=f"rdzv-member-{i}", daemon=True)
        for i in range(n)
    ]
    deadline = time.monotonic() + timeout_s + _GRACE_S
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    timed_out = [e for e in errors if type(e).__name__ == "RendezvousTimeoutError"]
    if timed_out or any(thread.is_alive() for thread in threads) or None in ranks:
        raise TimeoutError(f"{n} members: no rendezvous within {timeout_s:g} s")
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} members failed: {errors[0]!r}") from errors[0]
    got = [pair for pair in ranks if pair is not None]
    if sorted(rank for rank, _ in got) != list(range(n)):
        raise RuntimeError(f"ranks are not 0..{n - 1}")
    if any(world != n for _, world in got):
        raise RuntimeError(f"world sizes differ from {n}")
    return max(ends) - start[0]


def _shutdown(handlers: Sequence[Any]) -> None:
    """Close the rendezvous the way an agent does at exit (also stops heartbeat timers)."""
    for handler in handlers:
        handler.shutdown()


def measure_c10d(n: int, timeout_s: float = 300.0) -> float:
    """Seconds for n members to complete torchrun's default (``c10d``) rendezvous.

    The TCPStore server is hosted here on an OS-chosen loopback port (as the
    agent on the endpoint host would host it) and every member connects its
    own client (``is_host=False``).  Parameters set beyond the endpoint:
    ``join_timeout`` = ``timeout_s`` so torch itself gives up on time.  All
    else is torch's default: TCPStore ``read_timeout`` 60 s, 1 s poll between
    state syncs, a random 0-0.3 s start skew per member on the first round,
    and rank 0 hosting the shared TCPStore for the job, which torchrun does too.
    """
    from torch.distributed import TCPStore

    server = TCPStore(LOOPBACK, 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=60))
    handlers: list[Any] = []
    try:
        params = _params(
            "c10d",
            f"{LOOPBACK}:{server.port}",
            n,
            timeout_s,
            is_host=False,
            join_timeout=math.ceil(timeout_s),
        )
        handlers = _create_handlers(params, n)
        elapsed = _race(handlers, timeout_s)
        _shutdown(handlers)
        return elapsed
    finally:
        handlers.clear()
        del server


class EtcdStartError(RuntimeError):
    """The throwaway etcd server could not be started."""


def _health(url: str) -> bool:
    """True once etcd answers /health, going direct (no proxy from the environment)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{url}/health", timeout=1) as resp:
            return b'"true"' in resp.read()
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def etcd_v2_server(timeout_s: float = 30.0) -> Iterator[str]:
    """Run a throwaway single-node etcd with the v2 API; yield its ``host:port``.

    torch's etcd backends speak only the v2 API, which etcd 3.5 serves only
    with ``--enable-v2``.  The client URL is advertised on loopback so that
    python-etcd's machine discovery never learns another address.  The server
    is killed and its data dir removed on exit, whatever happens.
    """
    binary = shutil.which("etcd")
    if binary is None:
        raise EtcdStartError("etcd binary not on PATH")
    client_url = f"http://{LOOPBACK}:{_free_port()}"
    # Raft peers on a unix socket in the (0700) data dir, etcd running there: no peer
    # port for another local user to post raft messages to.
    peer_url = "unix://peer:1"
    with (
        tempfile.TemporaryDirectory(prefix="torch-elastic-etcd-") as data_dir,
        tempfile.TemporaryFile() as log,
    ):
        proc = subprocess.Popen(
            [
                binary,
                "--name=bench",
                f"--data-dir={data_dir}",
                "--enable-v2=true",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=bench={peer_url}",
                "--log-level=error",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            cwd=data_dir,
        )
        try:
            deadline = time.monotonic() + timeout_s
            while not _health(client_url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read()[-500:].decode(errors="replace")
                    raise EtcdStartError(f"etcd did not become healthy: {tail}")
                time.sleep(0.02)  # polling /health: etcd offers no readiness signal
            yield client_url.removeprefix("http://")
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _python_etcd_problem(endpoint: str) -> str | None:
    """Why python-etcd can't serve torch here, or None if it can.

    Checks the import (torch silently falls back to a stub without it) and the
    v2 operations torch relies on: create-if-absent, read, compare-and-swap.
    """
    try:
        import etcd  # python-etcd
    except ImportError as exc:
        return f"python-etcd not importable ({exc}); pip install python-etcd"
    if not hasattr(etcd, "Client"):
        return f"module 'etcd' at {getattr(etcd, '__file__', '?')} is not python-etcd"
    host, port = endpoint.rsplit(":", 1)
    try:
        client = etcd.Client(host, int(port), read_timeout=10, allow_reconnect=True)
        key = f"/bench-probe/{uuid.uuid4().hex}"
        written = client.write(key, "a", prevExist=False)
        client.write(key, "b", prevIndex=written.modifiedIndex)
        if client.read(key).value != "b":
            return "python-etcd compare-and-swap did not take effect"
        try:
            client.write(key, "c", prevIndex=written.modifiedIndex)
            return "python-etcd stale compare-and-swap was not rejected"
        except etcd.EtcdCompareFailed:
            pass
        client.delete(key)
    except Exception as exc:  # any failure means the backend can't be measured
        return f"python-etcd fails against this etcd: {exc!r}"
    return None


def _measure_etcd(backend: str, n: int, timeout_s: float, config: dict[str, Any]) -> float | str:
    """Shared body of the etcd measurements: own server, probe, handlers, race."""
    handlers: list[Any] = []
    try:
        with etcd_v2_server() as endpoint:
            problem = _python_etcd_problem(endpoint)
            if problem is not None:
                return problem
            try:
                params = _params(backend, endpoint, n, timeout_s, **config)
                handlers = _create_handlers(params, n)
                elapsed = _race(handlers, timeout_s)
                _shutdown(handlers)
                return elapsed
            finally:
                handlers.clear()  # drop lease/heartbeat owners before etcd stops
    except EtcdStartError as exc:
        return f"etcd server unavailable: {exc}"


def measure_etcd_v2(n: int, timeout_s: float = 300.0) -> float | str:
    """Seconds for n members to complete the registry's ``etcd-v2`` rendezvous.

    That is ``etcd_rendezvous_backend.EtcdRendezvousBackend`` (python-etcd over
    etcd's v2 API, ``EtcdStore`` as the store) under ``DynamicRendezvousHandler``,
    the same handler as c10d, so the two differ only in the state backend.
    A fresh etcd 3.5 with ``--enable-v2`` is started for the run.  Parameter
    set: ``join_timeout`` = ``timeout_s``; everything else is torch's default
    (python-etcd read timeout 60 s, 1 s poll between syncs, 0-0.3 s start skew).
    Returns a string saying why, instead of a time, if python-etcd or etcd
    can't be used here.
    """
    return _measure_etcd("etcd-v2", n, timeout_s, {"join_timeout": math.ceil(timeout_s)})


@contextmanager
def _legacy_etcd_noise_filtered() -> Iterator[None]:
    """Quiet the legacy etcd handler for the duration of a measurement.

    Its module logger writes every INFO line (each carrying the whole state,
    O(n) long) straight to stderr, which for n=256 is megabytes of synchronous
    output inside the timed part, so it is raised to WARNING meanwhile.  Its
    per-run lease thread also dies at once on etcd 3.5 with "Not a file"
    (torch refreshes the run directory's TTL without ``dir=True``); the TTL is
    2 h, so this is harmless here, and those tracebacks are swallowed.  Any
    other uncaught thread exception still goes to the usual hook.
    """
    import logging

    # Import first: on import the module sets its logger to INFO itself.
    from torch.distributed.elastic.rendezvous import etcd_rendezvous

    logger = etcd_rendezvous.logger
    old_level, old_hook = logger.level, threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        thread_name = args.thread.name if args.thread is not None else ""
        if "lease_worker" in thread_name and "Not a file" in str(args.exc_value):
            return
        old_hook(args)

    logger.setLevel(logging.WARNING)
    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = old_hook
        logger.setLevel(old_level)


def measure_etcd_legacy(n: int, timeout_s: float = 300.0) -> float | str:
    """Seconds for n members to complete the registry's ``etcd`` (legacy) rendezvous.

    That is ``etcd_rendezvous.EtcdRendezvousHandler``: join by compare-and-swap
    with a random 0-0.1 s back-off per attempt, then a confirm round, waiting
    on etcd watches.  With min == max the n-th joiner freezes the rendezvous,
    so its 30 s last call never runs.  Parameter set: ``timeout`` = ``timeout_s``.
    Returns a string saying why, instead of a time, if it can't be measured.
    """
    with _legacy_etcd_noise_filtered():
        return _measure_etcd("etcd", n, timeout_s, {"timeout": math.ceil(timeout_s)})


MEASURES: dict[str, Callable[[int, float], float | str]] = {
    "c10d": measure_c10d,
    "etcd-v2": measure_etcd_v2,
    "etcd (legacy)": measure_etcd_legacy,
}


def _cell(result: float | str) -> str:
    """Seconds with 3 decimals, or the reason a backend was not measured."""
    return f"{result:.3f}" if isinstance(result, float) else f"n/a ({result})"


def main(sizes: Sequence[int] = SIZES, timeout_s: float = 300.0) -> None:
    """Print seconds to full rendezvous per backend and member count."""
    import torch

    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, one process, threads")
    print(f"{'n':>5}  " + "  ".join(f"{name:>14}" for name in MEASURES))
    for n in sizes:
        cells = []
        for measure in MEASURES.values():
            try:
                cells.append(_cell(measure(n, timeout_s)))
            except TimeoutError:
                cells.append(f"> {timeout_s:g} (timeout)")
            except Exception as exc:  # one failing backend should not hide the others
                cells.append(f"error ({exc!r})"[:60])
        print(f"{n:>5}  " + "  ".join(f"{cell:>14}" for cell in cells), flush=True)


if __name__ == "__main__":
    main()
