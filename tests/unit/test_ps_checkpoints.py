"""A server's checkpoint comes back as it was saved, or is refused naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordinator.ps.checkpoints import Checkpoints, Saved


def saved(layout: str = "L", trainers: int = 2, size: int = 6) -> Saved:
    return Saved(
        version=12,
        clocks={t: 3 + t for t in range(trainers)},
        params=torch.arange(size, dtype=torch.float32),
        optimizer={"kind": "sgd", "momentum": torch.ones(size)},
        layout=layout,
    )


def test_a_saved_checkpoint_resumes_as_it_was(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path / "deep" / "server-0.pt", every=4, resume=True)
    checkpoints.save(saved())
    back = checkpoints.to_resume("L", trainers=2, size=6)
    assert back is not None
    assert (back.version, back.clocks, back.layout) == (12, {0: 3, 1: 4}, "L")
    assert torch.equal(back.params, torch.arange(6, dtype=torch.float32))
    assert [p.name for p in checkpoints.path.parent.iterdir()] == ["server-0.pt"]  # no partial


def test_nothing_to_resume_without_resume_or_a_file(tmp_path: Path) -> None:
    Checkpoints(tmp_path / "a.pt", resume=False).save(saved())
    assert Checkpoints(tmp_path / "a.pt", resume=False).to_resume("L", 2, 6) is None
    assert Checkpoints(tmp_path / "none.pt", resume=True).to_resume("L", 2, 6) is None


@pytest.mark.parametrize(
    ("layout", "trainers", "size"), [("other", 2, 6), ("L", 3, 6), ("L", 2, 7)]
)
def test_another_models_or_trainer_counts_checkpoint_is_refused(
    tmp_path: Path, layout: str, trainers: int, size: int
) -> None:
    checkpoints = Checkpoints(tmp_path / "s.pt", resume=True)
    checkpoints.save(saved())
    with pytest.raises(ValueError, match=r"s\.pt is of another model or trainer count"):
        checkpoints.to_resume(layout, trainers, size)


def test_a_damaged_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "s.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"s\.pt is unreadable"):
        Checkpoints(path, resume=True).to_resume("L", 2, 6)


@pytest.mark.parametrize(("every", "due"), [(0, []), (5, [5, 10]), (1, list(range(1, 11)))])
def test_a_save_is_due_every_so_many_updates(every: int, due: list[int]) -> None:
    checkpoints = Checkpoints(Path("x"), every=every)
    assert [v for v in range(1, 11) if checkpoints.due(v)] == due
