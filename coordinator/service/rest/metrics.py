"""Prometheus metrics of one replica, on a registry of its own.

Jobs by state and job durations are read from etcd at scrape time, so every
replica reports the same numbers and nothing is lost on a restart; counters of
what this replica did (submissions, launches, restarts) and request latencies
are its own, as Prometheus expects from one scrape target.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from coordinator.service.model import JobState
from coordinator.service.store import JobStore

DURATION_BUCKETS = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)


class ServiceMetrics:
    def __init__(self, store: JobStore, counters: Callable[[], tuple[int, int]]) -> None:
        """`counters()` gives (members launched, restarts) by this replica's reconciler."""
        self.registry = CollectorRegistry()
        self.submissions = Counter(
            "coordinator_submissions",
            "Job submissions by outcome (created, existing, conflict, invalid)",
            ["outcome"],
            registry=self.registry,
        )
        self.requests = Histogram(
            "coordinator_request_seconds",
            "HTTP request latency",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.registry.register(_FromEtcd(store, counters))


class _FromEtcd(Collector):
    def __init__(self, store: JobStore, counters: Callable[[], tuple[int, int]]) -> None:
        self.store, self.counters = store, counters

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        by_state = dict.fromkeys(JobState, 0)
        durations: list[float] = []
        for stored in self.store.scan():
            record = stored.record
            by_state[record.state] += 1
            started = next((c.at for c in record.conditions if c.state == JobState.STARTING), None)
            if record.state.terminal and started is not None:
                durations.append(record.conditions[-1].at - started)
        jobs = GaugeMetricFamily("coordinator_jobs", "Jobs by state", labels=["state"])
        for state, count in by_state.items():
            jobs.add_metric([state.value], count)
        yield jobs
        buckets = [(str(b), float(sum(d <= b for d in durations))) for b in DURATION_BUCKETS]
        buckets.append(("+Inf", float(len(durations))))
        yield HistogramMetricFamily(
            "coordinator_job_duration_seconds",
            "Seconds from the first start to the final state, of finished jobs",
            buckets=buckets,
            sum_value=sum(durations),
        )
        launched, restarts = self.counters()
        launches = CounterMetricFamily(
            "coordinator_member_launches", "Members started by this replica's reconciler"
        )
        launches.add_metric([], launched)
        yield launches
        restarted = CounterMetricFamily(
            "coordinator_job_restarts", "Attempts after the first started by this replica"
        )
        restarted.add_metric([], restarts)
        yield restarted
