"""The chaos soak (tests/support/chaos.py): the whole product on a 3-member etcd while things die.

Two replicas of the service, three agents and a real etcd cluster, jobs of every
kind submitted at a steady rate, and one fault after another: the service leader,
an agent, the etcd leader or a member SIGKILLed, a replica's or an agent's way to
etcd cut for longer than its lease. Afterwards: no job lost, none run twice at
once, every failure says why, no process, lease or key left behind. The 50 s soak
runs with the slow tests; the ten-minute one is `python bench/chaos.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.chaos import FAULTS, print_report, soak


@pytest.mark.slow  # 90 s; the kill drill is in the default suite
@pytest.mark.timeout(400)
def test_a_short_chaos_soak_loses_nothing(tmp_path: Path) -> None:
    report = soak(seconds=50, jobs=15, seed=1, fault_every=9, root=tmp_path, drain=180)
    print_report(report)
    assert report.problems == []
    assert {f.kind for f in report.faults} == set(FAULTS)  # every kind of fault, once at least
    assert sum(report.outcomes.values()) == len(report.accepted) == 15
