"""The pure decisions behind the service's liveness (issue 28): when an etcd call counts
as wedged, when a standby may depose a silent leader, which NOSPACE alarm is unjustified."""

from __future__ import annotations

from pyetcd import etcdrpc

from coordinator.etcd.watchdog import Watchdog, most_overdue
from coordinator.service.control.alarms import unjustified
from coordinator.service.control.leadership import DEPOSE_SLACK, overdue, sighted


def test_a_call_counts_as_wedged_only_past_its_deadline_and_the_allowance() -> None:
    now = [100.0]
    dog = Watchdog(allowance=3.0, clock=lambda: now[0])
    with dog.call("request", 1.0):
        now[0] += 4.0  # at its deadline and the allowance: still no verdict
        assert dog.stalled() is None
        now[0] += 0.5
        reason = dog.stalled()
        assert reason is not None and "(request) is 3.5s past its deadline" in reason
    assert dog.stalled() is None and dog.in_flight() == 0


def test_the_most_overdue_call_is_named() -> None:
    limits = {1: ("keepalive", 10.0), 2: ("request", 5.0), 3: ("request", 50.0)}
    assert most_overdue(limits, 12.0) == ("request", 7.0)
    assert most_overdue(limits, 4.0) is None


def test_a_standby_deposes_only_after_ttl_and_slack_without_a_new_heartbeat() -> None:
    seen = sighted(None, leader_created=7, heartbeat=20, now=0.0)
    assert sighted(seen, 7, 20, 3.0) is seen  # nothing changed: the clock runs on
    assert not overdue(seen, ttl=5, now=5 + DEPOSE_SLACK)
    assert overdue(seen, ttl=5, now=5 + DEPOSE_SLACK + 0.01)
    beat = sighted(seen, 7, 21, 5.0)  # a heartbeat: the clock starts again
    assert beat.since == 5.0 and not overdue(beat, ttl=5, now=6.0)
    assert sighted(beat, 9, 21, 6.0).since == 6.0  # a new leader: so does it


def test_only_a_nospace_alarm_under_half_the_quota_is_unjustified() -> None:
    nospace = etcdrpc.AlarmMember(memberID=1, alarm=etcdrpc.AlarmType.Value("NOSPACE"))
    assert unjustified([nospace], db_size=10, quota=100) == [nospace]
    assert unjustified([nospace], db_size=50, quota=100) == []
    assert unjustified([], db_size=10, quota=100) == []
