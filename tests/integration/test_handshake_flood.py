"""A member's port flooded with idle connections before the handshake (issue 28, item 4):
real handshakes still succeed, at least 95 % of them.

A real `MemberEndpoint` holding the round's secret, with the cap a member of 8 gets; a
flooder process (its own, so it competes for the CPU as an attacker would) opens idle
connections from the same loopback address as the real callers, as fast as it can from
4 threads holding 300 each. Meanwhile 4 threads make 48 real handshakes, one attempt
each. Before issue 28 every connection counted against one cap of 32: 0 of 48 got in.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from coordinator.rendezvous import handshake
from coordinator.rendezvous.admission import Admission
from coordinator.rendezvous.endpoint import MemberEndpoint
from tests.support.wait import wait_until

JOB, ROUND, MEMBER = "flooded", 3, "member-zero"
WORLD = 8
CAP = 2 * WORLD + 16  # what `rendezvous.member` gives a member's endpoint
REAL, CALLERS = 48, 4
ATTEMPT_TIMEOUT = 5.0  # seconds one real handshake may take

#: Opens connections that send FIRST (nothing, or a byte) and then idle, from 4 threads,
#: each holding up to HOLD; prints how many it opened when stdin closes.
FLOODER = """
import collections, socket, sys, threading
port, hold, first = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].encode()
stop, opened = threading.Event(), []
def flood():
    held, count = collections.deque(), 0
    while not stop.is_set():
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1)
            held.append(sock)
            sock.sendall(first)  # nothing, or one byte of a response that never ends
            count += 1
        except OSError:
            pass
        while len(held) > hold:
            held.popleft().close()
    opened.append(count)
threads = [threading.Thread(target=flood) for _ in range(4)]
for thread in threads:
    thread.start()
sys.stdin.read()
stop.set()
for thread in threads:
    thread.join()
print(sum(opened), flush=True)
"""


@pytest.fixture
def endpoint() -> Iterator[tuple[MemberEndpoint, handshake.HandshakeKey]]:
    secret = handshake.new_secret()
    served = MemberEndpoint(JOB, MEMBER, "127.0.0.1", max_connections=CAP)
    served.authorize(secret, ROUND)
    try:
        yield served, handshake.key_for(secret, JOB, ROUND, MEMBER)
    finally:
        served.close()


def real_handshakes(port: int, key: handshake.HandshakeKey) -> list[str | None]:
    """`REAL` handshakes from `CALLERS` threads, one attempt each: None for a success,
    else why it failed."""
    results: list[str | None] = []
    lock = threading.Lock()

    def caller() -> None:
        for _ in range(REAL // CALLERS):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=ATTEMPT_TIMEOUT)
                with sock:
                    handshake.offer(sock, key, ATTEMPT_TIMEOUT)
                outcome = None
            except OSError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            with lock:
                results.append(outcome)

    threads = [threading.Thread(target=caller) for _ in range(CALLERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REAL * ATTEMPT_TIMEOUT)
    return results


@pytest.mark.parametrize("first", ["", "C"], ids=["idle", "one-byte"])
def test_real_handshakes_succeed_during_a_flood_of_idle_connections(
    endpoint: tuple[MemberEndpoint, handshake.HandshakeKey], first: str
) -> None:
    """The flood's connections say nothing, or one byte of a response and no more."""
    served, key = endpoint
    flooder = subprocess.Popen(
        [sys.executable, "-c", FLOODER, str(served.port), "300", first],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        per_source = Admission(CAP, 1.0).per_source
        # Every room the flood can take is taken (before issue 28: the one cap).
        full = min(per_source, CAP)
        wait_until(lambda: served.active >= full, 30, "the flood to fill its room")
        began = time.monotonic()
        results = real_handshakes(served.port, key)
        took = time.monotonic() - began
        assert served.pending <= per_source  # the flood never held more than its half
        assert flooder.poll() is None, "the flooder stopped before the handshakes ended"
    finally:
        opened, _ = flooder.communicate("", timeout=30) if flooder.poll() is None else ("?", "")
        if flooder.poll() is None:
            flooder.kill()
            flooder.wait()
    succeeded = results.count(None)
    print(
        f"\nhandshake flood ({first or 'idle'}): {succeeded}/{len(results)} real handshakes "
        f"succeeded in {took:.1f} s while the flooder opened {opened.strip()} connections"
    )
    assert len(results) == REAL
    assert succeeded >= 0.95 * REAL, [r for r in results if r is not None][:5]
    wait_until(lambda: served.pending == 0, 5, "the idle ones dropped once the flood ended")
