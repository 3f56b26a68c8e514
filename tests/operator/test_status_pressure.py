"""A job's status under pressure and bad data: a pod a ResourceQuota refuses leaves the job Pending saying why
(the rule a gang created in part already follows: gang.unfinished), and garbage in the operator's own status
fields (memstrata.api.jobstatus) is read as absent, never acted on, and removed with a warning."""
from __future__ import annotations

from typing import Any

import pytest
from ftj_factories import at, inventory, job_dict, node_dict, pod_dict

from memstrata.api.jobstatus import read_fields
from memstrata.operator import bookkeeping, gang
from memstrata.operator.actions import CreateAttempt, Decision, DeletePods, Event, PatchStatus
from memstrata.operator.lifecycle import LifecyclePolicy, decide
from memstrata.operator.nodes import node_view
from memstrata.operator.observe import job_view, pod_view
from memstrata.operator.scheduling import place

QUOTA_ERROR = ('POST /api/v1/namespaces/team-a/pods: 403 Forbidden: pods "llama-0" is forbidden: exceeded quota: '
               'pods, requested: pods=1, used: pods=1, limited: pods=1')
NODES = [node_view(node_dict("gpu-1", inventory("gpu-1", dram_gib=1024)))]


def _decide(job: dict[str, Any], pods: list[dict[str, Any]], t: float) -> Decision:
    return decide(job_view(job), [pod_view(p) for p in pods], at(t), lambda spec: place(spec, NODES, {}),
                  LifecyclePolicy())


def _apply(job: dict[str, Any], d: Decision) -> list[Event]:
    for a in d.of(PatchStatus):
        for k, v in a.patch.items():
            job["status"].pop(k, None) if v is None else job["status"].__setitem__(k, v)
    job["metadata"]["finalizers"] = ["memstrata.dev/cleanup"]
    return list(d.of(Event))


def _created(job: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in job["status"]["conditions"] if c["type"] == "Created")


def test_a_pod_the_quota_refuses_leaves_the_job_pending_saying_why_and_spends_no_attempt() -> None:
    job = job_dict()
    told = []
    for t in range(3):  # the quota refuses every try: the reconciler records why, as for a gang (NothingCreated)
        (create,) = _decide(job, [], t).of(CreateAttempt)
        assert create.attempt == 0  # the same attempt each time: nothing was made
        told += _apply(job, gang.unfinished(job_view(job), at(t), create, QUOTA_ERROR, partly=False))
    status = job["status"]
    assert status["phase"] == "Pending" and "exceeded quota" in status["message"], status
    assert _created(job)["status"] == "False" and _created(job)["reason"] == "PodCreateFailed"
    assert "exceeded quota" in _created(job)["message"] and "llama-0" in _created(job)["message"]
    assert not {"attempts", "activePod", "node", "nodes", "plan"} & set(status), status
    assert [e.reason for e in told] == ["PodCreateFailed"]  # said once, not on every try
    d = _decide(job, [], 3)  # the quota was raised
    (create,) = d.of(CreateAttempt)
    _apply(job, d)
    assert create.attempt == 0 and job["status"]["phase"] == "Created" and job["status"]["attempts"] == 1
    assert _created(job)["status"] == "True" and _created(job)["reason"] == "PodCreated"


def _running(**run_policy: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    job = job_dict(run_policy=run_policy)
    _apply(job, _decide(job, [], 0))
    pods = [pod_dict("llama-0", 0, "Running", node="gpu-1")]
    _apply(job, _decide(job, pods, 1))
    assert job["status"]["phase"] == "Running" and job["status"]["activePod"] == "llama-0"
    return job, pods


@pytest.mark.parametrize("field, value", [
    ("failedPods", "abc"), ("failedPods", ["abc"]), ("failedPods", [5]), ("attempts", "x"), ("attempts", True),
    ("attempts", -1), ("activePod", "zzz"), ("activePod", "llama-7"), ("activePod", 5), ("lastFailure", "boom"),
    ("lastFailure", {"pod": "llama-0", "message": "m", "time": "soon"}), ("shortfalls", 5),
    ("shortfalls", [{"stratum": "dram"}]), ("announcedCheckpoint", "x"), ("announcedResume", -1),
])
def test_a_malformed_bookkeeping_field_is_never_acted_on_and_is_repaired_with_a_warning(field: str, value: Any) -> None:
    """backoffLimit 0: a garbage field read as one failure (failedPods "abc" was three; activePod zzz a pod that
    disappeared) would fail the job and delete its running pod; attempts "x" stopped every reconcile."""
    job, pods = _running(backoffLimit=0)
    job["status"][field] = value
    d = _decide(job, pods, 2)
    told = _apply(job, d)
    assert not d.of(DeletePods) and not d.of(CreateAttempt), d
    status = job["status"]
    assert status["phase"] == "Running" and "failedPods" not in status and "lastFailure" not in status, status
    # What the operator observes writes the field anew (the pod it owns); the rest is removed.
    assert status.get(field) == {"activePod": "llama-0", "attempts": 1}.get(field), status
    (warning,) = [e for e in told if e.reason == "MalformedStatus"]
    assert warning.type == "Warning" and warning.message.startswith(f"status.{field}"), warning
    assert _apply(job, _decide(job, pods, 3)) == [] and _decide(job, pods, 3).actions == ()  # said once


def test_reading_keeps_what_reads_and_says_why_of_the_rest() -> None:
    status, why, _ = bookkeeping.read("llama", {
        "phase": "Restarting", "attempts": 2, "activePod": "llama-1", "failedPods": ["llama-0", "abc"],
        "lastFailure": {"pod": "llama-0", "reason": "Error", "message": "m", "time": "2026-01-01T12:00:00+00:00"}})
    assert why == {"failedPods": "status.failedPods: 'abc' names no pod of job llama"}
    assert status == {"phase": "Restarting", "attempts": 2, "activePod": "llama-1", "failedPods": ["llama-0"],
                      "lastFailure": {"pod": "llama-0", "reason": "Error", "message": "m",
                                      "time": "2026-01-01T12:00:00Z"}}
    assert bookkeeping.read("llama", {"attempts": 1, "activePod": "llama-1"})[1] == {
        "activePod": "status.activePod: 'llama-1' is attempt 2, but status.attempts says 1 were made"}
    values, problems = read_fields({"attempts": "x", "failedPods": "abc", "shortfalls": None})
    assert values.model_fields_set == set() and problems == {
        "attempts": "status.attempts: Input should be a valid integer (got 'x')",
        "failedPods": "status.failedPods: Input should be a valid list (got 'abc')"}
