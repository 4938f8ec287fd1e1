"""The endpoint's admission books (pure): pending handshakes apart from channels, half the
pending room per source, the oldest making room, and the timeouts."""

from __future__ import annotations

import pytest

from coordinator.rendezvous.admission import Admission


def test_the_caps_follow_the_channel_cap() -> None:
    small, large = Admission(6, 5.0), Admission(200, 5.0)
    assert (small.pending_cap, small.per_source) == (128, 64)
    assert (large.pending_cap, large.per_source) == (400, 200)
    assert Admission(6, 1.0).first_byte == 1.0 and Admission(6, 5.0).first_byte == 2.0
    with pytest.raises(ValueError, match="max_connections"):
        Admission(0, 5.0)


def test_one_source_holds_half_and_its_oldest_one_makes_room() -> None:
    books = Admission(6, 5.0)
    for conn in range(64):
        assert books.arrive(conn, "10.0.0.9", 0.0) == []
    books.heard(0)  # talking or not: the oldest makes room
    assert books.arrive(64, "10.0.0.9", 0.1) == [0]
    assert books.pending == 64
    # Another source still has its own half.
    for conn in range(100, 164):
        assert books.arrive(conn, "10.0.0.1", 0.2) == []
    assert books.pending == 128
    # The room is full: a third source's newcomer takes the busiest source's oldest silent.
    assert books.arrive(200, "10.0.0.2", 0.3) == [1]


def test_a_trickle_of_bytes_holds_no_room_either() -> None:
    books = Admission(6, 5.0)
    for conn in range(64):
        books.arrive(conn, "h", 0.0)
        books.heard(conn)  # each sent a byte, and no more
    assert books.arrive(99, "h", 0.0) == [0]  # the oldest makes room all the same
    assert books.arrive(100, "h", 0.0) == [1]  # by age: a real caller is silent at first


def test_silent_ones_expire_after_the_first_byte_timeout_talking_ones_after_the_handshake() -> None:
    books = Admission(6, 5.0)
    books.arrive(1, "h", 0.0)
    books.arrive(2, "h", 0.0)
    books.heard(2)
    assert books.next_deadline() == 2.0
    assert books.expired(1.9) == [] and books.expired(2.0) == [1]
    assert books.next_deadline() == 5.0 and books.expired(5.0) == [2]
    assert books.pending == 0 and books.next_deadline() is None


def test_channels_are_counted_apart_and_capped() -> None:
    books = Admission(2, 5.0)
    books.arrive(1, "h", 0.0)
    books.leave(1)
    assert books.open_channel() and books.open_channel() and not books.open_channel()
    books.close_channel()
    assert books.open_channel() and books.pending == 0 and books.channels == 2
