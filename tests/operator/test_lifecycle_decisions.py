"""The FineTuneJob state machine, driven through whole lifecycles by a small simulated world of
API dicts: each decision is applied (status merged, pods created/deleted) and the next one taken."""
from __future__ import annotations

from typing import Any

import pytest
from ftj_factories import at, inventory, job_dict, node_dict, pod_dict

from memstrata.operator.actions import (
    AddFinalizer, CleanupChildren, CreateAttempt, DeleteJob, DeletePods, Event, PatchStatus,
)
from memstrata.operator.lifecycle import Decision, LifecyclePolicy, decide
from memstrata.operator.nodes import node_view
from memstrata.operator.observe import job_view, pod_view
from memstrata.operator.scheduling import place

POLICY = LifecyclePolicy(backoff_base_seconds=10, backoff_max_seconds=40, unschedulable_retry_seconds=30)


class World:
    def __init__(self, nodes: list[dict[str, Any]] | None = None, **job_kw: Any) -> None:
        self.job = job_dict(**job_kw)
        self.pods: dict[str, dict[str, Any]] = {}
        self.nodes = [node_view(n) for n in (nodes or [node_dict("gpu-1", inventory("gpu-1", dram_gib=1024))])]
        self.created: list[CreateAttempt] = []
        self.events: list[Event] = []
        self.deleted_job = False

    def decide(self, t: float = 0.0) -> Decision:
        views = [pod_view(p) for p in self.pods.values()]
        return decide(job_view(self.job), views, at(t), lambda spec: place(spec, self.nodes, {}), POLICY)

    def step(self, t: float = 0.0) -> Decision:
        d = self.decide(t)
        for a in d.actions:
            if isinstance(a, CreateAttempt):
                self.created.append(a)
                name = f"{self.job['metadata']['name']}-{a.attempt}"
                self.pods.setdefault(name, pod_dict(name, a.attempt))
            elif isinstance(a, DeletePods):
                for n in a.names:
                    self.pods[n]["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
            elif isinstance(a, PatchStatus):
                status = self.job["status"]
                for k, v in a.patch.items():
                    status.pop(k, None) if v is None else status.__setitem__(k, v)
            elif isinstance(a, Event):
                self.events.append(a)
            elif isinstance(a, DeleteJob):
                self.deleted_job = True
            elif isinstance(a, AddFinalizer):
                self.job["metadata"].setdefault("finalizers", []).append("memstrata.dev/cleanup")
        return d

    def settle(self, t: float = 0.0) -> Decision:
        """Step until nothing changes (a level-triggered controller's fixed point)."""
        for _ in range(10):
            d = self.step(t)
            if not any(d.of(k) for k in (PatchStatus, CreateAttempt, DeletePods, AddFinalizer)):
                return d
        raise AssertionError("decisions did not converge")

    def pod(self, attempt: int, phase: str, **kw: Any) -> None:
        name = f"{self.job['metadata']['name']}-{attempt}"
        self.pods[name] = pod_dict(name, attempt, phase, **kw)

    def gone(self, attempt: int) -> None:
        del self.pods[f"{self.job['metadata']['name']}-{attempt}"]

    @property
    def status(self) -> dict[str, Any]:
        return self.job["status"]

    def condition(self, type_: str) -> dict[str, Any] | None:
        return next((c for c in self.status.get("conditions", []) if c["type"] == type_), None)


def test_happy_path_created_scheduled_running_succeeded_with_events():
    w = World()
    d = w.step()
    assert [c.attempt for c in d.of(CreateAttempt)] == [0] and d.of(CreateAttempt)[0].node == "gpu-1"
    assert w.status["phase"] == "Created" and w.status["activePod"] == "llama-0" and w.status["node"] == "gpu-1"
    assert w.status["plan"]["feasible"] is True and w.status["startTime"] == "2026-01-01T12:00:00Z"
    assert w.condition("Created")["status"] == "True"
    assert w.settle().actions == ()  # nothing more to do while the pod waits

    w.pod(0, "Pending", node="gpu-1")
    w.settle(1)
    assert w.status["phase"] == "Scheduled" and w.condition("Scheduled")["status"] == "True"
    w.pod(0, "Running", node="gpu-1")
    w.settle(2)
    assert w.status["phase"] == "Running" and w.condition("Running")["status"] == "True"
    w.pod(0, "Succeeded", node="gpu-1", exit_code=0)
    w.settle(3)
    assert w.status["phase"] == "Succeeded" and w.condition("Succeeded")["status"] == "True"
    assert w.condition("Running") == {**w.condition("Running"), "status": "False", "reason": "PodSucceeded"}
    assert w.status["completionTime"] == "2026-01-01T12:00:03Z" and "activePod" not in w.status
    assert len(w.created) == 1
    reasons = [e.reason for e in w.events]
    assert reasons == ["PodCreated", "PodScheduled", "PodRunning", "PodSucceeded", "PodSucceeded"]


def test_the_runtimes_status_fields_are_never_written_by_the_operator():
    """status.output, progress and peakMemory are the runtime's (RUNTIME_STATUS_FIELDS): no decision patches them,
    so a status patch of the operator never clobbers the saved model's report."""
    from memstrata.api.report import RUNTIME_STATUS_FIELDS

    w = World()
    w.step()
    w.pod(0, "Running", node="gpu-1")
    w.settle(1)
    runtime = {"output": {"path": "/output/m", "step": 2000, "files": 4, "bytes": 1 << 34},
               "progress": {"step": 2000, "total": 2000}, "peakMemory": {"dram": 1 << 30}}
    w.status.update(runtime)
    w.pod(0, "Succeeded", node="gpu-1", exit_code=0)
    patches = [a.patch for t in (2, 3) for a in w.step(t).of(PatchStatus)]
    assert patches and w.status["phase"] == "Succeeded"
    assert not any(set(p) & set(RUNTIME_STATUS_FIELDS) for p in patches), patches
    assert {k: w.status[k] for k in runtime} == runtime


def test_a_rerun_after_a_crash_between_pod_and_status_adopts_the_pod():
    w = World()
    first = w.decide()
    assert first.of(CreateAttempt)
    w.pod(0, "Pending")  # the pod was created, then the operator died before patching status
    d = w.step()
    assert not d.of(CreateAttempt)
    assert w.status["activePod"] == "llama-0" and w.status["attempts"] == 1


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_backoff_limit_n_means_exactly_n_plus_1_attempts(limit):
    w = World(run_policy={"backoffLimit": limit})
    t = 0.0
    w.settle(t)
    for attempt in range(limit + 1):
        w.pod(attempt, "Failed", node="gpu-1", exit_code=3)
        t += 100  # past any backoff
        w.settle(t)
        w.settle(t + 100)
        t += 100
    assert len(w.created) == limit + 1
    assert w.status["phase"] == "Failed" and w.condition("Failed")["reason"] == "BackoffLimitExceeded"
    assert f"backoffLimit is {limit}" in w.status["message"] and "exit code 3" in w.status["message"]
    assert w.status["failedPods"] == [f"llama-{i}" for i in range(limit + 1)]


def test_backoff_delays_the_next_attempt_and_doubles():
    w = World(run_policy={"backoffLimit": 3})
    w.settle(0)
    w.pod(0, "Failed", node="gpu-1", exit_code=1)
    d = w.settle(5)
    assert not w.created[1:] and w.status["phase"] == "Restarting"
    assert d.requeue_after == pytest.approx(10)
    assert w.condition("Restarting")["reason"] == "BackoffAfterFailure"
    w.settle(15)
    assert [c.attempt for c in w.created] == [0, 1]
    assert [e.reason for e in w.events].count("PodCreated") == 2  # the retry announces its pod too
    w.pod(1, "Running", node="gpu-1")
    w.settle(16)
    assert w.status["phase"] == "Running" and w.condition("Restarting")["status"] == "False"
    assert w.status["restarts"] == 1
    w.pod(1, "Failed", node="gpu-1", exit_code=1)
    d = w.settle(20)
    assert d.requeue_after == pytest.approx(20) and len(w.created) == 2  # 10 s doubled


def test_a_failed_pod_deleted_by_someone_still_counts():
    w = World(run_policy={"backoffLimit": 1})
    w.settle(0)
    w.pod(0, "Failed", node="gpu-1", exit_code=1)
    w.settle(1)
    w.gone(0)
    w.settle(100)
    assert len(w.created) == 2 and w.status["failedPods"] == ["llama-0"]


def test_a_running_pod_that_disappears_is_a_failed_attempt():
    w = World(run_policy={"backoffLimit": 1})
    w.settle(0)
    w.pod(0, "Running", node="gpu-1")
    w.settle(1)
    w.gone(0)
    w.settle(2)
    assert "llama-0 disappeared" in w.status["message"] and w.status["failedPods"] == ["llama-0"]


def test_suspend_deletes_pods_and_resume_starts_a_new_attempt_without_counting_a_failure():
    w = World(run_policy={"activeDeadlineSeconds": 3600})
    w.settle(0)
    w.pod(0, "Running", node="gpu-1")
    w.settle(1)
    w.job["spec"]["runPolicy"]["suspend"] = True
    d = w.step(2)
    assert d.of(DeletePods)[0].names == ("llama-0",)
    w.settle(2)
    assert w.status["phase"] == "Suspended" and w.condition("Suspended")["status"] == "True"
    assert "startTime" not in w.status and "activePod" not in w.status
    w.pods["llama-0"]["status"]["phase"] = "Failed"  # a kubelet marks a killed pod Failed before removal
    w.settle(3)
    assert "failedPods" not in w.status

    w.job["spec"]["runPolicy"]["suspend"] = False
    w.settle(10)
    assert [c.attempt for c in w.created] == [0, 1] and w.condition("Suspended")["reason"] == "Resumed"
    assert w.status["startTime"] == "2026-01-01T12:00:10Z" and "failedPods" not in w.status
    assert {"Suspended", "Resumed"} <= {e.reason for e in w.events}


def test_a_job_created_suspended_never_gets_a_pod():
    w = World(run_policy={"suspend": True})
    w.settle(0)
    assert w.created == [] and w.status["phase"] == "Suspended"


def test_active_deadline_fails_the_job_and_deletes_its_pod():
    w = World(run_policy={"activeDeadlineSeconds": 60})
    w.settle(0)
    w.pod(0, "Running", node="gpu-1")
    d = w.settle(30)
    assert d.requeue_after == pytest.approx(30)
    d = w.step(61)
    assert d.of(DeletePods) and w.status["phase"] == "Failed"
    assert w.condition("Failed")["reason"] == "DeadlineExceeded" and "activeDeadlineSeconds (60s)" in w.status["message"]


def test_ttl_after_finished_deletes_the_job_on_time():
    w = World(run_policy={"ttlSecondsAfterFinished": 100})
    w.settle(0)
    w.pod(0, "Succeeded", node="gpu-1", exit_code=0)
    d = w.settle(10)
    assert d.requeue_after == pytest.approx(100) and not w.deleted_job
    d = w.settle(60)
    assert d.requeue_after == pytest.approx(50) and not w.deleted_job
    w.settle(110)
    assert w.deleted_job


def test_no_room_waits_pending_unschedulable_and_schedules_when_room_frees():
    w = World(nodes=[node_dict("gpu-1", inventory("gpu-1", dram_gib=1024), cordoned=True)])
    d = w.settle(0)
    assert w.status["phase"] == "Pending" and w.condition("Scheduled")["reason"] == "Unschedulable"
    assert d.waiting_for_room and d.requeue_after == 30 and w.created == []
    assert any(e.type == "Warning" and e.reason == "Unschedulable" for e in w.events)
    w.nodes = [node_view(node_dict("gpu-1", inventory("gpu-1", dram_gib=1024)))]
    w.settle(40)
    assert [c.node for c in w.created] == ["gpu-1"] and w.status["phase"] == "Created"


def test_impossible_job_fails_at_once_with_per_stratum_shortfall():
    w = World(nodes=[node_dict("small", inventory("small", dram_gib=64, nvme=0))])
    w.settle(0)
    assert w.created == [] and w.status["phase"] == "Failed"
    assert w.condition("Failed")["reason"] == "InsufficientMemory"
    assert [s["stratum"] for s in w.status["shortfalls"]] == ["nvme"]
    assert w.status["shortfalls"][0]["missingBytes"] > 70 * 2**30
    assert any(e.type == "Warning" and e.reason == "InsufficientMemory" for e in w.events)


def test_pod_the_scheduler_cannot_place_is_reported_and_waits():
    w = World()
    w.settle(0)
    w.pod(0, "Pending", unschedulable="0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")
    d = w.settle(1)
    assert w.status["phase"] == "Created" and d.waiting_for_room
    assert "Insufficient nvidia.com/gpu" in w.condition("Scheduled")["message"]


def test_finished_job_deletes_a_stray_pod():
    w = World()
    w.settle(0)
    w.status.update({"phase": "Succeeded", "completionTime": "2026-01-01T12:00:00Z"})
    w.pod(5, "Running", node="gpu-1")
    assert w.decide(1).of(DeletePods)[0].names == ("llama-0", "llama-5")


def test_the_finalizer_is_added_first_and_released_only_when_no_pod_is_left():
    w = World()
    first = w.decide(0)
    assert isinstance(first.actions[0], AddFinalizer) and first.of(CreateAttempt)
    w.settle(0)
    assert w.job["metadata"]["finalizers"] == ["memstrata.dev/cleanup"]
    assert not w.decide(1).of(AddFinalizer)
    w.pod(0, "Running", node="gpu-1")
    w.job["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:09Z"
    d = w.decide(10)
    assert d.actions == (CleanupChildren(release=False),) and d.requeue_after == 1.0
    w.pods["llama-0"]["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:10Z"
    assert w.decide(11).actions == (CleanupChildren(release=False),)  # terminating still counts
    w.gone(0)
    assert w.decide(12).actions == (CleanupChildren(release=True),)
    w.job["metadata"]["finalizers"] = ["someone.else/keep"]
    assert w.decide(13).actions == ()


def test_invalid_spec_fails_with_the_field_named():
    w = World()
    w.job["spec"]["training"]["steps"] = 0
    w.settle(0)
    assert w.status["phase"] == "Failed" and w.condition("Failed")["reason"] == "InvalidSpec"
    assert "spec.training.steps" in w.status["message"]


def test_duplicate_active_pods_keep_the_newest():
    w = World()
    w.settle(0)
    w.pod(0, "Running", node="gpu-1")
    w.pod(1, "Running", node="gpu-1")
    d = w.step(1)
    assert d.of(DeletePods)[0].names == ("llama-0",) and w.status["activePod"] == "llama-1"


def test_job_labels_reach_the_pod_but_reserved_ones_do_not():
    from memstrata.operator.render import pod

    w = World(labels={"team": "nlp", "memstrata.dev/job-uid": "spoof"})
    create = w.decide().of(CreateAttempt)[0]
    manifest = pod(job_view(w.job), create.node, create.plan, create.attempt)
    assert manifest["metadata"]["labels"]["team"] == "nlp"
    assert manifest["metadata"]["labels"]["memstrata.dev/job-uid"] == "uid-1"
