"""The operator's Prometheus metrics: what a cluster admin watches every controller by.

Counters and histograms are bumped where things happen (a reconcile ends, an API request returns, a job's
first pod is created); the rest is read at scrape time from the live state that already holds it (the work
queue, the jobs the watch has seen, the Lease), so it can never drift from what the operator acts on.
Each OperatorMetrics has a registry of its own: two in one process (tests) do not collide.
"""
from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "memstrata_operator"
# Reconciles are a few API calls; create-to-pod includes placement and waiting for room.
RECONCILE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
API_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CREATE_TO_POD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 7200.0)


@dataclass
class LiveState:
    """What the gauges read at scrape time; each is set by the part of the operator that owns it."""

    queue_depth: Callable[[], int] = lambda: 0
    reconciling: Callable[[], int] = lambda: 0
    phases: Callable[[], Iterable[str]] = lambda: ()
    leading: Callable[[], bool] = lambda: True
    lease: str = ""
    identity: str = ""


class _Live(Collector):
    def __init__(self, state: LiveState) -> None:
        self.state = state

    def collect(self) -> Iterable[GaugeMetricFamily]:
        s = self.state
        yield GaugeMetricFamily(f"{PREFIX}_workqueue_depth", "Jobs waiting in the work queue for a worker",
                                value=s.queue_depth())
        yield GaugeMetricFamily(f"{PREFIX}_workqueue_running", "Jobs being reconciled now", value=s.reconciling())
        jobs = GaugeMetricFamily(f"{PREFIX}_jobs", "FineTuneJobs the operator knows, by status.phase",
                                 labels=["phase"])
        for phase, n in sorted(Tally(s.phases()).items()):
            jobs.add_metric([phase], n)
        yield jobs
        leader = GaugeMetricFamily(f"{PREFIX}_leader", "1 while this replica holds the Lease and acts, else 0",
                                   labels=["lease", "identity"])
        leader.add_metric([s.lease or "(standalone)", s.identity], 1.0 if s.leading() else 0.0)
        yield leader


class OperatorMetrics:
    """The operator's instruments, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.live = LiveState()
        r.register(_Live(self.live))
        self.reconciles = Counter(f"{PREFIX}_reconcile", "Reconciles by result: success, error, conflict "
                                  "(re-read at once) or not_leading (left to the next leader)", ["result"], registry=r)
        self.reconcile_errors = Counter(f"{PREFIX}_reconcile_errors", "Failed reconciles by reason: the API "
                                        "server's reason, or the exception's type", ["reason"], registry=r)
        self.reconcile_seconds = Histogram(f"{PREFIX}_reconcile_duration_seconds", "Time per reconcile",
                                           buckets=RECONCILE_BUCKETS, registry=r)
        self.api_seconds = Histogram(f"{PREFIX}_api_request_duration_seconds", "Kubernetes API requests the "
                                     "reconciler made, by verb and HTTP status (0: no answer)", ["verb", "code"],
                                     buckets=API_BUCKETS, registry=r)
        self.create_to_pod = Histogram(f"{PREFIX}_job_create_to_pod_seconds", "From a job's creationTimestamp to "
                                       "its first training pod created", buckets=CREATE_TO_POD_BUCKETS, registry=r)
        self.events = Counter(f"{PREFIX}_events", "Kubernetes Events posted on jobs, by type and reason",
                              ["type", "reason"], registry=r)

    def api_seconds_observer(self) -> Callable[[str, int, float], None]:
        """What the API client calls after each request: (verb, HTTP status or 0, seconds)."""
        return lambda verb, code, seconds: self.api_seconds.labels(verb, str(code)).observe(seconds)


def phase_of(body: Mapping[str, Any]) -> str:
    """A job's phase as the gauge counts it; a job the operator has not written yet is Pending."""
    return str((body.get("status") or {}).get("phase") or "Pending")
