"""The FineTuneJob state machine, driven through whole lifecycles by a small simulated world of
API dicts: each decision is applied (status merged, pods created/deleted) and the next one taken."""
from __future__ import annotations

from typing import Any

import pytest
from ftj_factories import at, inventory, job_dict, node_dict, pod_dict

from memstrata.api.jobstatus import FineTuneJobStatus
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
                FineTuneJobStatus.model_validate(status)  # every field the operator writes is declared, typed
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


def test_only_the_users_prefix_reaches_the_pod():
    """`app: web` copied would make the pod an endpoint of the web app's Service; memstrata.dev/ keys are the
    operator's selectors; Kueue's would have Kueue act on the pod itself. Only user.memstrata.dev/ keys are copied
    (a queued job's pods: test_kueue.py)."""
    from memstrata.operator.render import pod

    w = World(labels={"team": "nlp", "app": "web", "memstrata.dev/job-uid": "spoof", "memstrata.dev/attempt": "9",
                      "app.kubernetes.io/name": "web", "user.memstrata.dev/team": "nlp",
                      "kueue.x-k8s.io/managed": "true"})
    create = w.decide().of(CreateAttempt)[0]
    labels = pod(job_view(w.job), create.node, create.plan, create.attempt)["metadata"]["labels"]
    assert labels == {"user.memstrata.dev/team": "nlp",
                      "memstrata.dev/job-uid": "uid-1", "memstrata.dev/job-name": w.job["metadata"]["name"],
                      "memstrata.dev/attempt": "0", "app.kubernetes.io/managed-by": "memstrata-operator"}


# -- checkpoints and resume ----------------------------------------------------------------------------------

CHECKPOINT_SPEC = {"path": "/output/ckpt", "everySteps": 100}


def checkpointed(step: int, seconds: float = 42.0) -> dict[str, Any]:
    """status.checkpoint as the runtime writes it."""
    return {"path": f"/output/ckpt/step-{step:08d}", "step": step, "time": "2026-01-01T12:10:00Z",
            "bytes": 17 << 30, "seconds": seconds}


def running_with_checkpoints(**kw: Any) -> World:
    w = World(**kw)
    w.job["spec"]["checkpoint"] = dict(CHECKPOINT_SPEC)
    w.settle(0)
    w.pod(0, "Running", node="gpu-1")
    w.settle(1)
    w.events.clear()
    return w


def test_each_checkpoint_is_announced_once_however_often_the_job_is_reconciled():
    w = running_with_checkpoints()
    w.status["checkpoint"] = checkpointed(100)
    d = w.step(2)
    # The mark goes in the status patch before the event: a patch refused (a conflict) posts nothing.
    kinds = [type(a).__name__ for a in d.actions]
    assert kinds == ["PatchStatus", "Event"] and d.of(PatchStatus)[0].patch == {"announcedCheckpoint": 100}
    assert w.events == [Event("Normal", "Checkpointed",
                              "step 100 written to /output/ckpt/step-00000100 in 42.0s, 17.0 GiB")]
    # Progress reports trigger reconciles all the time; an operator restart reads the same status.
    w.status["progress"] = {"step": 130, "total": 2000, "attempt": 0}
    for t in (3, 4, 5):
        assert w.step(t).actions == ()
    w.status["checkpoint"] = checkpointed(200, seconds=125)
    w.settle(6)
    assert [e.message for e in w.events[1:]] == ["step 200 written to /output/ckpt/step-00000200 in 2m05s, 17.0 GiB"]
    assert w.status["phase"] == "Running"


def test_an_attempt_that_resumed_is_announced_once_and_a_previous_attempts_report_is_not_taken_for_it():
    w = running_with_checkpoints(run_policy={"backoffLimit": 2})
    w.status["progress"] = {"step": 0, "total": 2000, "attempt": 0}  # attempt 1 started from scratch
    w.status["checkpoint"] = checkpointed(100)
    w.settle(2)
    assert [e.reason for e in w.events] == ["Checkpointed"]
    w.pod(0, "Failed", node="gpu-1", exit_code=1)
    w.settle(3)
    w.settle(20)  # past the backoff: attempt 2's pod
    assert [c.attempt for c in w.created] == [0, 1]
    w.pod(1, "Running", node="gpu-1")
    w.settle(21)
    assert "Resumed" not in [e.reason for e in w.events]  # attempt 2 has not reported yet
    w.status["progress"] = {"step": 100, "total": 2000, "attempt": 1, "resumedFrom": 100}
    w.settle(22)
    w.settle(23)
    resumed = [e for e in w.events if e.reason == "Resumed"]
    assert resumed == [Event("Normal", "Resumed", "attempt 2 resumed from checkpoint step 100")]

    # Attempt 3 fails before its first report: status.progress is still attempt 2's, so nothing is said for it.
    w.pod(1, "Failed", node="gpu-1", exit_code=1)
    w.settle(24)
    w.settle(60)
    w.pod(2, "Running", node="gpu-1")
    w.settle(61)
    assert [e.reason for e in w.events].count("Resumed") == 1
    w.status["progress"] = {"step": 100, "total": 2000, "attempt": 2, "resumedFrom": 100}  # the same checkpoint
    w.settle(62)
    assert [e.message for e in w.events if e.reason == "Resumed"][1:] == [
        "attempt 3 resumed from checkpoint step 100"]
    assert w.status["restarts"] == 2


def test_a_progress_report_that_names_no_attempt_announces_no_resume():
    w = running_with_checkpoints()
    w.status["progress"] = {"step": 100, "total": 2000, "resumedFrom": 100}  # a runtime that predates attempt
    w.settle(2)
    assert w.events == [] and "announcedResume" not in w.status


def test_a_checkpoint_status_the_operator_cannot_read_is_not_announced_and_breaks_nothing():
    w = running_with_checkpoints()
    w.status["checkpoint"] = {"path": "/output/ckpt"}  # hand-edited: no step, no time
    w.settle(2)
    assert w.events == [] and w.status["phase"] == "Running"


def test_a_checkpoint_written_while_the_job_is_being_suspended_is_announced():
    w = running_with_checkpoints()
    w.job["spec"]["runPolicy"]["suspend"] = True
    w.settle(2)
    w.status["checkpoint"] = checkpointed(150)  # the stopping pod saved its state
    w.settle(3)
    assert w.status["phase"] == "Suspended" and [e.reason for e in w.events].count("Checkpointed") == 1


def test_a_finished_job_announces_nothing_more():
    w = running_with_checkpoints()
    w.pod(0, "Succeeded", node="gpu-1", exit_code=0)
    w.settle(2)
    w.events.clear()
    w.status["checkpoint"] = checkpointed(2000)  # e.g. a job finished under an operator that did not announce
    assert w.settle(3).actions == () and w.events == []


def _config_of(w: World, create: CreateAttempt) -> dict[str, Any]:
    """The runtime config the reconciler renders for an attempt the lifecycle asked for."""
    import json

    from memstrata.operator.render import gang_objects

    companions, _ = gang_objects(job_view(w.job), (create.node,), create.plan, create.attempt,
                                    architecture=create.architecture)
    cm = next(o for o in companions if o["kind"] == "ConfigMap")
    return json.loads(next(iter(cm["data"].values())))


@pytest.mark.parametrize("end, failed", [
    ("failed", True),  # the runtime crashed: the pod Failed
    ("evicted", True),  # the kubelet evicted it (memory pressure): Failed with reason Evicted
    ("deleted", True),  # its node was lost, or someone deleted it: terminating before it finished
    ("vanished", True),  # gone altogether before the operator saw it end
    ("suspended", False),  # the user suspended the job and unsuspended it
])
def test_every_way_an_attempt_ends_gets_a_new_attempt_that_resumes_from_the_checkpoint(end, failed):
    w = running_with_checkpoints(run_policy={"backoffLimit": 3})
    w.status["checkpoint"] = checkpointed(100)
    w.settle(2)
    if end == "failed":
        w.pod(0, "Failed", node="gpu-1", exit_code=137)
    elif end == "evicted":
        w.pod(0, "Failed", node="gpu-1")
        w.pods["llama-0"]["status"]["reason"] = "Evicted"
    elif end == "deleted":
        w.pods["llama-0"]["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:03Z"
    elif end == "vanished":
        w.gone(0)
    else:
        w.job["spec"]["runPolicy"]["suspend"] = True
        w.settle(3)
        w.gone(0)
        w.settle(4)
        w.job["spec"]["runPolicy"]["suspend"] = False
    w.settle(5)
    if failed:  # a failure waits out the backoff first
        assert len(w.created) == 1 and w.status["phase"] == "Restarting"
        w.settle(15)
    assert [c.attempt for c in w.created] == [0, 1]
    assert w.status["restarts"] == (1 if failed else 0) and w.status["attempts"] == 2
    assert w.status.get("failedPods", []) == (["llama-0"] if failed else [])
    config = _config_of(w, w.created[-1])
    defaults = {"keep": 2, "exportModel": False}
    assert config["attempt"] == 1 and config["spec"]["checkpoint"] == {**CHECKPOINT_SPEC, **defaults}
    assert w.status["checkpoint"]["step"] == 100  # the runtime's report stays until the new attempt's


def test_unsuspending_after_an_old_failure_starts_at_once_and_keeps_the_restarts():
    """Suspension is the user's pause, not a failure: no backoff, no warning about a failure long past."""
    w = running_with_checkpoints(run_policy={"backoffLimit": 3})
    w.pod(0, "Failed", node="gpu-1", exit_code=1)
    w.settle(2)
    w.settle(20)
    w.pod(1, "Running", node="gpu-1")
    w.settle(21)
    assert w.status["restarts"] == 1 and w.condition("Restarting")["status"] == "False"
    w.job["spec"]["runPolicy"]["suspend"] = True
    w.settle(30)
    w.gone(1)
    w.settle(31)
    w.events.clear()
    w.job["spec"]["runPolicy"]["suspend"] = False
    w.settle(100)
    assert [c.attempt for c in w.created] == [0, 1, 2]
    assert w.status["phase"] == "Created" and w.status["restarts"] == 1 and w.status["failedPods"] == ["llama-0"]
    assert [(e.type, e.reason) for e in w.events] == [("Normal", "PodCreated"), ("Normal", "Resumed")]
    w.pod(2, "Pending", node="gpu-1")
    w.settle(101)
    assert w.status["phase"] == "Scheduled"  # not Restarting: nothing failed since the job was unsuspended
    # A failure after the unsuspend is a failure again: backoff (20 s, the second one) and Restarting.
    w.pod(2, "Failed", node="gpu-1", exit_code=1)
    d = w.settle(102)
    assert w.status["phase"] == "Restarting" and d.requeue_after == pytest.approx(20) and len(w.created) == 3


def test_suspending_during_a_backoff_ends_it():
    w = running_with_checkpoints(run_policy={"backoffLimit": 3})
    w.pod(0, "Failed", node="gpu-1", exit_code=1)
    w.settle(2)
    assert w.condition("Restarting")["status"] == "True"
    w.job["spec"]["runPolicy"]["suspend"] = True
    w.settle(3)
    assert w.condition("Restarting") == {**w.condition("Restarting"), "status": "False", "reason": "Suspended"}
    w.job["spec"]["runPolicy"]["suspend"] = False
    w.settle(4)  # within what was the backoff: starts at once all the same
    assert [c.attempt for c in w.created] == [0, 1] and w.status["restarts"] == 1
