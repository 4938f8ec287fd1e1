"""Which uid a job's programs get, and which folders they can reach (pure decisions)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.jobs.run_as import parse_uid_range, pick_uid, unreachable_folder

UIDS = range(61000, 61004)


@pytest.mark.parametrize(
    ("text", "message"),
    [("61000", "FIRST-LAST"), ("a-b", "FIRST-LAST"), ("10-20", "1000 <= FIRST"),
     ("62000-61000", "FIRST <= LAST"), ("-61000", "FIRST-LAST")],
)  # fmt: skip
def test_a_bad_range_is_refused_naming_the_rule(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_uid_range(text)


def test_a_range_is_inclusive() -> None:
    assert parse_uid_range("61000-61003") == UIDS


def test_members_of_one_job_share_its_uid_and_other_jobs_take_the_next_in_turn() -> None:
    assert pick_uid(UIDS, {}, "a") == 61000
    assert pick_uid(UIDS, {"a": 61000}, "a", last=61002) == 61000
    assert pick_uid(UIDS, {"a": 61000}, "b", last=61000) == 61001
    # A finished job's uid is not given again until the range has gone round.
    assert pick_uid(UIDS, {}, "c", last=61001) == 61002
    assert pick_uid(UIDS, {"d": 61000}, "e", last=61003) == 61001


def test_no_uid_when_every_one_is_held() -> None:
    held = {f"job{i}": uid for i, uid in enumerate(UIDS)}
    assert pick_uid(UIDS, held, "late") is None


@pytest.fixture
def open_folder() -> Iterator[Path]:
    """A folder in /tmp that others may enter (pytest's tmp_path is closed to them)."""
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    folder.chmod(0o711)
    yield folder
    shutil.rmtree(folder)


def test_a_folder_others_may_not_enter_is_named(open_folder: Path) -> None:
    closed = open_folder / "closed"
    inner = closed / "inner"
    inner.mkdir(parents=True)
    assert unreachable_folder(open_folder, 61000) is None
    closed.chmod(0o700)
    assert unreachable_folder(inner, 61000) == closed
    closed.chmod(0o711)
    assert unreachable_folder(inner, 61000) is None
    if os.geteuid() == 0:  # its owner may enter what others may not
        os.chown(closed, 61000, 61000)
        closed.chmod(0o700)
        assert unreachable_folder(inner, 61000) is None
