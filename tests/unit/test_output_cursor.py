"""The one reader of members' output (pure): whole lines, at most a cap a read, a partial
line kept for its end, and a line longer than any read passed over."""

from __future__ import annotations

from coordinator.service.launchers import OUTPUT_CAP
from coordinator.service.output_cursor import OutputCursor


def reader(output: bytearray):  # type: ignore[no-untyped-def]
    """A launcher's `output` of one member, as every launcher answers: capped."""
    return lambda offset: bytes(output[offset : offset + OUTPUT_CAP])


def test_whole_lines_only_and_a_partial_one_waits_for_its_end() -> None:
    output = bytearray(b"one\ntw")
    cursor: OutputCursor[str] = OutputCursor()
    assert cursor.read("m", reader(output)) == b"one\n"
    assert cursor.read("m", reader(output)) == b""
    output += b"o\nthree"
    assert cursor.read("m", reader(output)) == b"two\n"
    assert cursor.offset("m") == len(b"one\ntwo\n")


def test_more_than_a_cap_is_read_read_after_read_to_its_end() -> None:
    line = b"x" * 1000 + b"\n"
    output = bytearray(line * (3 * OUTPUT_CAP // len(line)))
    reads: list[int] = []
    capped = reader(output)

    def counted(offset: int) -> bytes:
        reads.append(offset)
        return capped(offset)

    cursor: OutputCursor[int] = OutputCursor()
    assert cursor.read(0, counted) == bytes(output)
    assert len(reads) == 4  # three full reads, then the short one that ends it


def test_a_line_longer_than_any_read_is_passed_over() -> None:
    output = bytearray(b"a\n" + b"y" * (2 * OUTPUT_CAP + 10) + b"\nb\n")
    cursor: OutputCursor[int] = OutputCursor()
    assert cursor.read(0, reader(output)) == b"a\nb\n"
    assert cursor.offset(0) == len(output)


def test_forgotten_members_start_again_from_zero() -> None:
    output = bytearray(b"one\n")
    cursor: OutputCursor[tuple[str, int]] = OutputCursor()
    cursor.read(("job", 1), reader(output))
    cursor.read(("job", 2), reader(output))
    cursor.forget(lambda key: key[1] == 1)
    assert (cursor.offset(("job", 1)), cursor.offset(("job", 2))) == (0, 4)
