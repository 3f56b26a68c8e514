"""A FineTuneJob queued through Kueue (memstrata.operator.kueue): the decisions, pure.

The Workload statuses fed here are those the real Kueue 0.17 writes (copied from e2e/kueue's runs: the condition
types, reasons and messages); e2e/operator/test_kueue.py runs the same lifecycle against the real Kueue.
"""
from __future__ import annotations

from typing import Any

from ftj_factories import at, inventory, job_dict, node_dict, pod_dict

from memstrata.api.jobstatus import FineTuneJobStatus
from memstrata.operator import kueue, kueuewire
from memstrata.operator.actions import (
    AddFinalizer, CreateAttempt, CreateWorkload, Decision, DeletePods, Event, PatchStatus, WorkloadWrite,
)
from memstrata.operator.lifecycle import LifecyclePolicy, decide
from memstrata.operator.nodes import node_view
from memstrata.operator.observe import job_view, pod_view
from memstrata.operator.render import container_requests, pod
from memstrata.operator.scheduling import place

POLICY = LifecyclePolicy(backoff_base_seconds=10.0, kueue=True)
QUEUE = {"kueue.x-k8s.io/queue-name": "team-a"}
PENDING = ("couldn't assign flavors to pod set workers: insufficient unused quota for nvidia.com/gpu in flavor "
           "default, 1 more needed")
PREEMPTED = ("Preempted to accommodate a workload (UID: ccf3eb85, JobUID: UNKNOWN) due to prioritization in the "
             "ClusterQueue; preemptor path: /cq; preemptee path: /cq")


def cond(type_: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T12:00:00Z"}


class KueueWorld:
    """A queued job, its pods and its Workload; Kueue's part (admit, evict) is written by the test."""

    def __init__(self, nodes: int = 1, priority: tuple[str, int] | None = None, **job_kw: Any) -> None:
        self.job = job_dict(labels={**QUEUE, **job_kw.pop("labels", {})}, **job_kw)
        if nodes > 1:
            self.job["spec"]["resources"]["nodes"] = nodes
        self.nodes = [node_view(node_dict(f"gpu-{i}", inventory(f"gpu-{i}", dram_gib=1024))) for i in range(3)]
        self.pods: dict[str, dict[str, Any]] = {}
        self.workload: dict[str, Any] | None = None
        self.writes: list[WorkloadWrite] = []
        self.events: list[Event] = []
        self.priority, self.priority_error = priority, ""

    def decide(self, t: float = 0.0) -> Decision:
        wl = kueuewire.workload_view(self.workload) if self.workload is not None else None
        queue = kueue.Queue(wl, lambda spec: place(spec, self.nodes, {}), self.priority, self.priority_error)
        return decide(job_view(self.job), [pod_view(p) for p in self.pods.values()], at(t),
                      lambda spec: place(spec, self.nodes, {}), POLICY, queue)

    def step(self, t: float = 0.0) -> Decision:
        d = self.decide(t)
        for a in d.actions:
            if isinstance(a, CreateWorkload):
                self.workload = {**a.body, "metadata": {**a.body["metadata"], "resourceVersion": "1"}, "status": {}}
            elif isinstance(a, WorkloadWrite):
                self.writes.append(a)
                assert self.workload is not None
                where = "status" if a.subresource else "spec"
                for key, value in a.patch.get(where, {}).items():
                    section = self.workload.setdefault(where, {})
                    section.pop(key, None) if value is None else section.__setitem__(key, value)
                notes = self.workload["metadata"].setdefault("annotations", {})
                for key, value in ((a.patch.get("metadata") or {}).get("annotations") or {}).items():
                    notes.pop(key, None) if value is None else notes.__setitem__(key, value)
            elif isinstance(a, CreateAttempt):
                for rank, node in a.creates:
                    name = f"{self.job['metadata']['name']}-{a.attempt}" + (f"-{rank}" if len(a.placed) > 1 else "")
                    self.pods[name] = pod_dict(name, a.attempt, "Running", node=node)
            elif isinstance(a, DeletePods):
                for n in a.names:
                    self.pods[n]["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
            elif isinstance(a, PatchStatus):
                status = self.job.setdefault("status", {})
                for k, v in a.patch.items():
                    status.pop(k, None) if v is None else status.__setitem__(k, v)
                FineTuneJobStatus.model_validate(status)
            elif isinstance(a, Event):
                self.events.append(a)
            elif isinstance(a, AddFinalizer):
                self.job["metadata"].setdefault("finalizers", []).append("memstrata.dev/cleanup")
        return d

    # -- Kueue's writes, as the real one makes them --------------------------------------------------------------
    def pending(self) -> None:
        assert self.workload is not None
        self.workload["status"] = {"conditions": [cond("QuotaReserved", "False", "Pending", PENDING)]}

    def admit(self, flavor: str = "default") -> None:
        assert self.workload is not None
        podset = self.workload["spec"]["podSets"][0]
        requests = podset["template"]["spec"]["containers"][0]["resources"]["requests"]
        self.workload["status"] = {
            "admission": {"clusterQueue": "cq", "podSetAssignments": [
                {"name": podset["name"], "count": podset["count"], "flavors": {r: flavor for r in requests},
                 "resourceUsage": requests}]},
            "conditions": [cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
                           cond("Admitted", "True", "Admitted", "The workload is admitted")]}

    def preempt(self) -> None:
        assert self.workload is not None
        self.workload["status"]["conditions"] += [cond("Evicted", "True", "Preempted", PREEMPTED),
                                                  cond("Preempted", "True", "InClusterQueue", PREEMPTED)]

    @property
    def status(self) -> dict[str, Any]:
        return self.job.setdefault("status", {})

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.status.get("conditions", []) if c["type"] == type_)


def test_a_queued_job_gets_a_workload_of_its_pods_requests_and_no_pod():
    w = KueueWorld(priority=("research-high", 1000))
    d = w.step()
    assert not d.of(CreateAttempt) and not w.pods
    body = d.of(CreateWorkload)[0].body
    spec = job_view(w.job).spec
    assert spec is not None
    plan = place(spec, w.nodes, {}).plan
    assert plan is not None
    want = {r: str(n) for r, n in container_requests(spec, plan).items()}
    assert "nvidia.com/gpu" in want and "memory" in want
    podset = body["spec"]["podSets"][0]
    assert podset["count"] == 1
    assert podset["template"]["spec"]["containers"][0]["resources"] == {"requests": want, "limits": want}
    assert body["spec"]["queueName"] == "team-a" and body["spec"]["active"] is True
    assert body["spec"]["priority"] == 1000 and body["spec"]["priorityClassRef"]["name"] == "research-high"
    owner = body["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "uid-1" and owner["controller"] is True  # deleted with the job
    assert w.status["phase"] == "Queued" and w.condition("Queued")["reason"] == "WorkloadCreated"


def test_a_multi_node_job_is_one_podset_of_all_its_pods_so_kueue_admits_them_together():
    w = KueueWorld(nodes=2)
    body = w.step().of(CreateWorkload)[0].body
    assert [p["count"] for p in body["spec"]["podSets"]] == [2]


def test_waiting_says_why_in_kueues_words_and_starts_nothing():
    w = KueueWorld()
    w.step()
    w.pending()
    d = w.step()
    assert not d.of(CreateAttempt) and not d.of(CreateWorkload) and not w.pods
    assert w.status["phase"] == "Queued"
    queued = w.condition("Queued")
    assert queued["status"] == "True" and queued["reason"] == "Pending" and PENDING in queued["message"]
    assert "LocalQueue team-a" in queued["message"]


def test_admission_starts_the_first_attempt_and_its_running_pod_makes_the_workload_pods_ready():
    w = KueueWorld()
    w.step()
    w.admit()
    d = w.step()
    assert [a.attempt for a in d.of(CreateAttempt)] == [0]
    create = d.of(CreateAttempt)[0]
    labels = pod(job_view(w.job), create.node, create.plan, create.attempt)["metadata"]["labels"]
    assert "kueue.x-k8s.io/queue-name" not in labels  # or Kueue's pod integration would queue the pod by itself
    ready = [c for a in d.of(WorkloadWrite) for c in a.patch["status"]["conditions"] if c["type"] == "PodsReady"]
    assert [(c["status"], c["reason"]) for c in ready] == [("False", "WaitForStart")]  # what waitForPodsReady reads
    d = w.step()  # its pod runs
    ready = [c for a in d.of(WorkloadWrite) for c in a.patch["status"]["conditions"] if c["type"] == "PodsReady"]
    assert [c["status"] for c in ready] == ["True"]
    assert not w.step().of(WorkloadWrite)  # written once
    assert w.condition("Queued")["status"] == "False" and w.condition("Queued")["reason"] == "Admitted"
    assert "ClusterQueue cq" in w.condition("Queued")["message"]


def test_preemption_stops_the_pods_clears_the_admission_and_the_next_admission_is_a_new_attempt_not_a_failure():
    w = KueueWorld()
    w.step()
    w.admit()
    w.step()
    w.step()
    assert list(w.pods) == ["llama-0"]
    w.preempt()
    d = w.step()
    # First the status stops naming the pod (so that a pod gone before that write lands is no failed attempt) ...
    assert not d.of(DeletePods) and w.status["phase"] == "Queued" and "activePod" not in w.status
    assert w.condition("Queued")["reason"] == "Preempted"
    assert any(e.type == "Warning" and e.reason == "Preempted" for e in w.events)
    d = w.step()  # ... then it is deleted
    assert d.of(DeletePods)[0].names == ("llama-0",) and "Preempted" in d.of(DeletePods)[0].why
    assert not d.of(WorkloadWrite)  # the admission is cleared only once no pod runs undeleted
    # Being deleted, it counts no more (as in Kueue's Job integration: a pod on a lost node may never finish
    # terminating; the scheduler still counts its room until it is gone).
    d = w.step()
    release = d.of(WorkloadWrite)[0]
    assert release.subresource == "status" and release.patch["metadata"]["resourceVersion"] == "1"
    conds = {c["type"]: c for c in release.patch["status"]["conditions"]}
    assert release.patch["status"]["admission"] is None
    assert (conds["QuotaReserved"]["status"], conds["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert conds["Admitted"]["status"] == "False"
    assert (conds["Requeued"]["status"], conds["Requeued"]["reason"]) == ("True", "Preempted")
    assert conds["Evicted"]["status"] == "True"  # Kueue's own condition, kept
    # Not admitted, so not ready: waitForPodsReady's clock starts anew at the next admission.
    assert (conds["PodsReady"]["status"], conds["PodsReady"]["reason"]) == ("False", "WaitForStart")
    del w.pods["llama-0"]
    w.admit()  # Kueue admits it again
    d = w.step()
    assert [a.attempt for a in d.of(CreateAttempt)] == [1]
    assert "failedPods" not in w.status and "lastFailure" not in w.status


def test_a_finished_job_marks_its_workload_finished_once():
    w = KueueWorld()
    w.step()
    w.admit()
    w.step()
    w.pods["llama-0"] = pod_dict("llama-0", 0, "Succeeded", node="gpu-0", exit_code=0)
    w.step()
    assert w.status["phase"] == "Succeeded"
    d = w.step()
    finished = {c["type"]: c for c in d.of(WorkloadWrite)[0].patch["status"]["conditions"]}["Finished"]
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")
    assert not w.step().of(WorkloadWrite)


def test_suspending_deactivates_the_workload_and_resuming_activates_it():
    w = KueueWorld()
    w.step()
    w.admit()
    w.step()
    w.job["spec"]["runPolicy"]["suspend"] = True
    d = w.step()
    assert d.of(WorkloadWrite)[0].patch["spec"] == {"active": False} and w.status["phase"] == "Suspended"
    assert w.workload is not None and w.workload["metadata"]["annotations"] == {kueuewire.SUSPENDED: "true"}
    w.job["spec"]["runPolicy"]["suspend"] = False
    d = w.step()
    assert any(a.patch.get("spec") == {"active": True} for a in d.of(WorkloadWrite))
    assert not w.workload["metadata"]["annotations"] and not d.of(CreateAttempt)


def test_a_workload_kueue_deactivated_stays_so_and_the_job_says_why():
    """Kueue deactivates a Workload past its requeuing limit or its maximum execution time: that ends the run,
    and the operator must not undo it."""
    w = KueueWorld()
    w.step()
    w.admit()
    w.step()
    w.step()
    assert w.workload is not None
    w.workload["spec"]["active"] = False
    w.workload["status"]["conditions"].append(cond("Evicted", "True", "DeactivatedDueToRequeuingLimitExceeded",
                                                   "exceeded the requeuing limit"))
    for _ in range(4):
        d = w.step()
        assert not any(a.patch.get("spec", {}).get("active") for a in d.of(WorkloadWrite))
    assert "llama-0" in w.pods and w.pods["llama-0"]["metadata"].get("deletionTimestamp")
    assert w.workload["status"].get("admission") is None  # released, as after a preemption
    assert w.status["phase"] == "Queued" and "Kueue deactivated its Workload" in w.status["message"]


def test_a_missing_priority_class_is_named_and_no_workload_is_made():
    w = KueueWorld(labels={"kueue.x-k8s.io/priority-class": "nope"})
    w.priority_error = "metadata.labels[kueue.x-k8s.io/priority-class] names WorkloadPriorityClass 'nope'"
    d = w.step()
    assert not d.of(CreateWorkload) and w.condition("Queued")["reason"] == "PriorityClassNotFound"
    assert "'nope'" in w.condition("Queued")["message"]


def test_a_job_no_node_can_hold_fails_before_it_queues():
    w = KueueWorld()
    w.nodes = [node_view(node_dict("small", inventory("small", dram_gib=1, nvme=0)))]
    d = w.step()
    assert not d.of(CreateWorkload) and w.status["phase"] == "Failed"


def test_a_queue_label_under_an_operator_without_kueue_waits_and_says_so():
    """Run, it would run past the quota its submitter asked to be held to."""
    w = KueueWorld()
    d = decide(job_view(w.job), [], at(0), lambda spec: place(spec, w.nodes, {}), LifecyclePolicy())
    assert not d.of(CreateAttempt) and not d.of(CreateWorkload)
    patch = d.of(PatchStatus)[0].patch
    queued = next(c for c in patch["conditions"] if c["type"] == "Queued")
    assert patch["phase"] == "Pending" and queued["reason"] == "NotQueued" and "--kueue" in queued["message"]


def test_an_admitted_job_goes_only_where_its_flavor_and_quota_allow():
    wl = kueuewire.Workload("w", "1", {}, {"clusterQueue": "cq"},
                        requests={"nvidia.com/gpu": 1, "memory": 100})
    pool = {"pool": "h100"}
    assert kueuewire.allows(wl, pool, {"pool": "h100", "x": "y"}, {"nvidia.com/gpu": 1, "memory": 100})
    assert not kueuewire.allows(wl, pool, {"pool": "a100"}, {"nvidia.com/gpu": 1, "memory": 100})
    assert not kueuewire.allows(wl, pool, {"pool": "h100"}, {"nvidia.com/gpu": 1, "memory": 101})
    assert not kueuewire.allows(wl, {}, {}, {"memstrata.dev/nvme-ns": 1})  # a resource it was not admitted for


def test_a_job_stays_queued_when_its_queue_label_is_removed_and_follows_a_new_queue_while_it_waits():
    w = KueueWorld()
    w.step()
    w.pending()
    assert w.status["workload"] == "llama-workload-uid1"
    w.job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "team-b"
    d = w.step()
    assert [a.patch["spec"] for a in d.of(WorkloadWrite)] == [{"queueName": "team-b"}]
    del w.job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]  # past its quota? no: it has a Workload
    d = w.step()
    assert not d.of(CreateAttempt) and w.status["phase"] == "Queued" and "LocalQueue team-b" in w.status["message"]
