"""A submission's admission, one call (pure: nothing is read from the disk or etcd): the
spec as stored, or a refusal naming its field."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.service.admission import Policy, Refused, Roots, admit
from coordinator.service.launchers.local import LocalLauncher
from coordinator.service.model import JobSpec, Launcher


class NeverRoomFor(LocalLauncher):
    """A real local launcher whose placement says no job of more than `most` fits."""

    def __init__(self, logs: Path, most: int) -> None:
        super().__init__(logs)
        self.most = most

    def never_fits(self, spec: JobSpec) -> str | None:
        return None if spec.workers <= self.most else f"only {self.most} fit"


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    roots = Roots.of(tmp_path / "data", tmp_path / "artifacts", tmp_path / "work")
    launchers = {
        Launcher.LOCAL: LocalLauncher(tmp_path / "logs"),
        Launcher.AGENTS: NeverRoomFor(tmp_path / "agent-logs", 3),
    }
    return Policy(launchers=launchers, max_workers=4, roots=roots, max_threads=2)


def refused(spec: JobSpec, policy: Policy) -> tuple[str, str]:
    with pytest.raises(Refused) as caught:
        admit(spec, policy)
    return caught.value.field, str(caught.value)


def test_an_admitted_spec_gets_its_launcher_its_id_and_its_paths_under_their_roots(
    policy: Policy,
) -> None:
    spec = admit(JobSpec(kind="xgboost", workers=2, params={"artifacts": "out"}), policy)
    assert spec.launcher == Launcher.LOCAL
    assert spec.id.startswith("xgboost-")
    assert spec.params["artifacts"] == str(policy.roots.artifacts / "out")
    named = JobSpec(id="mine", kind="noop", workers=1, launcher=Launcher.AGENTS)
    assert admit(named, policy) == named  # nothing to add


@pytest.mark.parametrize(
    ("spec", "field", "says"),
    [
        (JobSpec(kind="nope", workers=1), "kind", "unknown job kind 'nope'"),
        (JobSpec(kind="noop", workers=1, launcher=Launcher.DOCKER), "launcher", "not enabled"),
        (JobSpec(kind="noop", workers=5), "workers", "the service has 4 slots"),
        (JobSpec(kind="noop", workers=4, launcher=Launcher.AGENTS), "workers", "only 3 fit"),
        (JobSpec(kind="noop", workers=1, gpus_per_worker=1), "launcher", "gpus_per_worker"),
        (
            JobSpec(kind="xgboost", workers=1, params={"artifacts": "../out"}),
            "params.artifacts",
            "artifacts",
        ),
        (JobSpec(kind="xgboost", workers=1, params={"nthread": "9"}), "params.nthread", "2"),
        (JobSpec(kind="xgboost", workers=1, params={"rounds": "-1"}), "params", "rounds"),
    ],
)
def test_a_refusal_names_its_field(spec: JobSpec, field: str, says: str, policy: Policy) -> None:
    got_field, message = refused(spec, policy)
    assert got_field == field
    assert says in message
