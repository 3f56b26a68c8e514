"""What a cluster admin's Prometheus sees of the operator: `memstrata operator --metrics-bind-address`, the real
process against the real control plane, scraped over HTTP and parsed with prometheus-client's parser. Every
number is read before and after something a user does (jobs run, a ResourceQuota refuses a pod), and must move
by what happened."""
from __future__ import annotations

import time
from collections import Counter

import pytest

from e2e.operator.harness import SUCCEED_LABEL, apply_yaml, job, one_pod_quota, wait
from e2e.scrape import Samples, scrape

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _phase(cluster, ns: str) -> dict[str, str]:
    return {i["metadata"]["name"]: (i.get("status") or {}).get("phase", "")
            for i in cluster.get_json("ftj", "-n", ns)["items"]}


def _agrees(cluster, url: str) -> Samples | None:
    """A scrape whose jobs gauge says what the API server says of every job in the cluster, or None."""
    truth = Counter((i.get("status") or {}).get("phase") or "Pending"
                    for i in cluster.get_json("ftj", "--all-namespaces")["items"])
    s = scrape(url)
    gauge = {labels["phase"]: v for labels, v in s.series("memstrata_operator_jobs") if v}
    return s if gauge == {k: float(n) for k, n in truth.items()} else None


def test_the_operator_serves_metrics_that_move_with_jobs_and_a_quotas_refusal(memstrata_cluster, operator, ns, nodes):
    cluster = memstrata_cluster
    before = scrape(operator.metrics_url)
    # The Lease holder says so, under its own identity.
    assert before.value("memstrata_operator_leader", lease="memstrata-e2e", identity=operator.identity) == 1.0, \
        before.series("memstrata_operator_leader")
    assert before.has("memstrata_operator_workqueue_depth") and before.has("memstrata_operator_workqueue_running")

    nodes.add("metrics", dram_gib=64, gpus=4)
    one_pod_quota(cluster, ns)  # room on the node for both jobs, but a quota of one pod
    submitted = time.monotonic()
    for name in ("m1", "m2"):
        apply_yaml(cluster, job(name, labels={SUCCEED_LABEL: "true"}), ns)
    wait("both jobs Succeeded, one after the other", lambda: set(_phase(cluster, ns).values()) == {"Succeeded"},
         timeout=120)
    took = time.monotonic() - submitted
    # The jobs gauge says, by phase, what the API server says of every job.
    after = wait("the jobs gauge to agree with the API server", lambda: _agrees(cluster, operator.metrics_url),
                 timeout=30)
    assert after.value("memstrata_operator_jobs", phase="Succeeded") >= 2

    def grew(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    # Both jobs got their first pod: two create-to-pod observations, each no longer than the test waited.
    assert grew("memstrata_operator_job_create_to_pod_seconds_count") >= 2
    assert grew("memstrata_operator_job_create_to_pod_seconds_sum") > 0
    # The second job's pod was refused by the quota while the first ran: a failed reconcile, by the API
    # server's reason, and the Warning event the user saw for it.
    assert grew("memstrata_operator_reconcile_errors_total", reason="Forbidden") >= 1, _errors(after)
    assert grew("memstrata_operator_reconcile_total", result="error") >= 1
    assert grew("memstrata_operator_events_total", type="Warning", reason="ReconcileError") >= 1
    assert grew("memstrata_operator_reconcile_total", result="success") >= 4  # each job: placed, Running, Succeeded
    assert grew("memstrata_operator_reconcile_duration_seconds_count") == sum(
        grew("memstrata_operator_reconcile_total", result=r) for r in ("success", "error", "conflict", "not_leading"))
    # The API requests behind it, by verb and status: the pods created (201), the quota's refusal (403).
    assert grew("memstrata_operator_api_request_duration_seconds_count", verb="POST", code="201") >= 2
    assert grew("memstrata_operator_api_request_duration_seconds_count", verb="POST", code="403") >= 1
    print(f"\n[metrics] 2 jobs through a 1-pod quota in {took:.1f} s; create-to-pod mean "
          f"{grew('memstrata_operator_job_create_to_pod_seconds_sum') / 2:.2f} s; "
          f"{grew('memstrata_operator_reconcile_total'):.0f} reconciles, "
          f"{grew('memstrata_operator_api_request_duration_seconds_count'):.0f} API requests")

    # Deleted jobs leave the gauge: nothing counts a job that is gone.
    cluster.kubectl("delete", "ftj", "--all", "-n", ns, "--wait=true", timeout=120)
    wait("the gauge to agree again, the deleted jobs gone from it", lambda: _agrees(cluster, operator.metrics_url),
         timeout=30)


def _errors(s: Samples) -> list[dict[str, str]]:
    return [labels for labels, _ in s.series("memstrata_operator_reconcile_errors_total")]
