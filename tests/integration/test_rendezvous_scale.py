"""The rendezvous at scale: a roster that fits one etcd request at the largest N, read
as untrusted input, the largest N enforced, and requests per member flat in N."""

from __future__ import annotations

import json
import threading
import zlib
from typing import Any

import pytest
from pydantic import ValidationError

from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.rendezvous.errors import RendezvousError
from coordinator.rendezvous.member import Member, read_roster
from coordinator.rendezvous.roster import (
    MAX_UNPACKED_BYTES,
    MAX_WORLD_SIZE,
    PACKED_MAGIC,
    ROSTER_LIMIT_BYTES,
    Roster,
    RosterFormatError,
)
from coordinator.worker import EXIT_USAGE, WorkerOptions, run_worker
from tests.support.rosters import synthetic_roster

SECRET = "ab" * 32


def roster_of(n: int) -> Roster:
    """A roster as real members make it, with this module's secret."""
    return synthetic_roster(n, secret=SECRET)


def packed(document: dict[str, Any]) -> bytes:
    return PACKED_MAGIC + zlib.compress(json.dumps(document).encode())


def test_a_packed_roster_reads_back_whole() -> None:
    roster = roster_of(300)
    again = Roster.from_etcd(roster.packed())
    assert again == roster and again.secret_bytes == roster.secret_bytes
    assert Roster.from_etcd(roster.to_etcd().encode()) == roster  # plain JSON still reads


def test_the_largest_roster_fits_one_etcd_request() -> None:
    """At N = MAX_WORLD_SIZE the packed roster is under the leader's limit, itself under
    etcd's 1.5 MiB request limit; plain JSON would not be."""
    roster = roster_of(MAX_WORLD_SIZE)
    size = len(roster.packed())
    assert size < ROSTER_LIMIT_BYTES < 1.5 * 2**20, size
    assert size / MAX_WORLD_SIZE < 40  # bytes per member
    assert len(roster.to_etcd()) > size * 3


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (PACKED_MAGIC + b"not zlib", "not zlib data"),
        (PACKED_MAGIC + zlib.compress(b'{"a": 1}')[:-3], "cut short"),
        (PACKED_MAGIC + zlib.compress(b" " * (MAX_UNPACKED_BYTES + 1)), "more than"),
        (PACKED_MAGIC + zlib.compress(b"[" * 100_000), "not JSON"),
        (PACKED_MAGIC + zlib.compress(b"[1, 2]"), "not a JSON object"),
        (packed({"world_size": MAX_WORLD_SIZE + 1}), "world_size"),
        (packed({"world_size": 2, "member_id": ["a"]}), "column 'member_id'"),
    ],
)
def test_a_malformed_packed_roster_is_named_and_refused(value: bytes, message: str) -> None:
    with pytest.raises(RosterFormatError, match=message):
        Roster.from_etcd(value)
    with pytest.raises(RendezvousError, match="roster in etcd is malformed"):
        read_roster(value)


def test_a_packed_roster_entry_is_validated_and_the_secret_never_shown() -> None:
    document = json.loads(zlib.decompress(roster_of(3).packed()[len(PACKED_MAGIC) :]))
    document["port"][2] = 70_000
    with pytest.raises(ValidationError, match=r"members\.2\.port"):
        Roster.from_etcd(packed(document))
    with pytest.raises(RendezvousError) as raised:
        read_roster(packed(document))
    assert SECRET not in str(raised.value) and "members.2.port" in str(raised.value)


def test_a_world_size_above_the_largest_is_refused_at_worker_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    options = WorkerOptions(job_id="big", world_size=MAX_WORLD_SIZE + 1, etcd="127.0.0.1:1")
    assert run_worker(options) == EXIT_USAGE  # named before anything touches etcd
    assert f"above the largest supported, {MAX_WORLD_SIZE}" in capsys.readouterr().err


def requests_per_member(endpoint: str, namespace: str, n: int) -> float:
    """Run n member threads through every phase; etcd requests each sent, on average."""
    clients = [Etcd(endpoint, namespace=namespace) for _ in range(n)]
    errors: list[BaseException] = []
    for client in clients:
        client.operations = 0

    def one(etcd: Etcd) -> None:
        try:
            with Member(etcd, "flat", n, ttl=30, timeout=60) as member:
                member.rendezvous()
                member.barrier("training")
                member.cleaner()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(c,)) for c in clients]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "a member thread hung"
        if errors:
            raise errors[0]
        return sum(c.operations for c in clients) / n
    finally:
        for client in clients:
            client.close()


@pytest.mark.one_etcd  # what it counts does not depend on where etcd runs
def test_requests_per_member_stay_flat_in_n(etcd_server: EmbeddedEtcd, namespace: str) -> None:
    """Eight times the members cost each member no more requests (the leader's extra
    few are shared out); a step whose requests grew with N would show here."""
    small = requests_per_member(etcd_server.endpoint, namespace + "-a", 4)
    large = requests_per_member(etcd_server.endpoint, namespace + "-b", 32)
    assert large <= small * 1.25, (small, large)  # (room for a retry on a busy host)
    with Etcd(etcd_server.endpoint, namespace=namespace + "-b") as etcd:
        assert etcd.get_prefix(etcd.key("jobs") + "/")[0] == []  # all cleaned up
