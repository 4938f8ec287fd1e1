"""The kill drill, short: ten seeded trials (tests/support/drill.py) against the suite's etcd.

Each trial starts real `coordinator worker` processes with random start delays,
SIGKILLs a random one a random moment after it reaches a stage (start-up, each
rendezvous phase, the job), and checks the failure semantics of docs/rendezvous.md: no hang,
documented exit codes only, the ranked members fail within TTL + 2 s of a ranked
member's death, no rendezvous key outlives the TTL. A member killed before it took
a rank leaves the others unable to elect N ranks: they fail at the phase deadline
(6, or 5 repeating it). tests/support/drill.py says why each rule holds; the long
version is `python bench/drill.py --trials 100`; a failing trial runs again alone with
`python bench/drill.py --seed 13 --trial K`.
"""

from __future__ import annotations

import pytest

from coordinator.etcd.server import EmbeddedEtcd
from tests.support.drill import STAGES, DrillConfig, plan, run_trial

SEED = 13
TRIALS = 10


def test_the_trials_aim_at_every_stage() -> None:
    """Ten trials cover start-up, every phase and the job, and both job kinds."""
    plans = [plan(SEED, number, DrillConfig()) for number in range(TRIALS)]
    assert {p["target"] for p in plans} == set(STAGES)
    assert {p["kind"] for p in plans} == {"noop", "steps"}


@pytest.mark.one_etcd  # its subject is the members' failure, not where etcd runs
@pytest.mark.parametrize("number", range(TRIALS))
def test_kill_drill(number: int, etcd_server: EmbeddedEtcd, namespace: str) -> None:
    trial = run_trial(etcd_server.endpoint, namespace, SEED, number)
    assert trial.killed_after is not None or trial.stage == "ended", trial.summary()
    assert not trial.problems, "\n".join([trial.summary(), *trial.problems])
