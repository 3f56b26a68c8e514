"""A job whose model.path states no architecture: the inspection pod that reads config.json, and the lifecycle
around it. Pods are the real manifests (memstrata.operator.inspection.pod), finished as the kubelet reports a
container's end (state.terminated with the termination message)."""
from __future__ import annotations

from typing import Any

from ftj_factories import at, inventory, job_dict, node_dict

from memstrata.api.architecture import PRESETS, ModelArchitecture
from memstrata.operator import inspection, names
from memstrata.operator.actions import CreateAttempt, CreateInspection, DeletePods, Event, PatchStatus
from memstrata.operator.lifecycle import Decision, LifecyclePolicy, decide
from memstrata.operator.nodes import node_view
from memstrata.operator.observe import job_view, pod_view
from memstrata.operator.scheduling import place
from memstrata.plan import plan_job

LLAMA = PRESETS["llama3-8b"]
NODES = [node_view(node_dict("gpu-1", inventory("gpu-1", dram_gib=1024)))]
INSPECT = names.inspect_pod_name("llama", "uid-1")


class World:
    def __init__(self, **job_kw: Any) -> None:
        self.job = job_dict(**job_kw)
        del self.job["spec"]["model"]["architecture"]
        self.job["metadata"]["finalizers"] = ["memstrata.dev/cleanup"]
        self.pods: dict[str, dict[str, Any]] = {}
        self.events: list[Event] = []

    def step(self) -> Decision:
        d = decide(job_view(self.job), [pod_view(p) for p in self.pods.values()], at(0),
                   lambda spec: place(spec, NODES, {}), LifecyclePolicy(backoff_base_seconds=0))
        for a in d.actions:
            if isinstance(a, CreateInspection):
                self.pods[INSPECT] = inspection.pod(job_view(self.job))
            elif isinstance(a, CreateAttempt):
                name = names.pod_name("llama", a.attempt)
                self.pods[name] = {"metadata": {"name": name, "labels": {names.LABEL_ATTEMPT: str(a.attempt)}},
                                   "spec": {}, "status": {"phase": "Pending"}}
            elif isinstance(a, DeletePods):
                for n in a.names:
                    self.pods[n]["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
            elif isinstance(a, PatchStatus):
                for k, v in a.patch.items():
                    self.job["status"].pop(k, None) if v is None else self.job["status"].__setitem__(k, v)
            elif isinstance(a, Event):
                self.events.append(a)
        return d

    def inspection_ends(self, exit_code: int, message: str) -> None:
        """What the kubelet reports when the container exits: phase and the termination message."""
        self.pods[INSPECT]["status"] = {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "containerStatuses": [{"name": names.INSPECT_CONTAINER, "state": {"terminated": {
                "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "message": message,
                "finishedAt": "2026-01-01T12:01:00Z"}}}]}

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.job["status"]["conditions"] if c["type"] == type_)


def test_the_shape_is_read_before_any_attempt_and_planned_with():
    w = World()
    first = w.step()
    assert first.of(CreateInspection) and not first.of(CreateAttempt)
    assert w.job["status"]["phase"] == "Pending" and INSPECT in w.job["status"]["message"]
    assert w.condition("Inspected")["status"] == "False" and w.condition("Inspected")["reason"] == "Inspecting"
    w.pods[INSPECT]["status"] = {"phase": "Running"}
    waiting = w.step()  # running: nothing new to create
    assert not waiting.of(CreateInspection) and not waiting.of(CreateAttempt)

    w.inspection_ends(0, LLAMA.model_dump_json(by_alias=True))
    done = w.step()
    (create,) = done.of(CreateAttempt)
    assert create.architecture == LLAMA
    assert create.plan == plan_job(job_view(job_dict()).spec, NODES[0].inventory)  # as if stated inline
    assert done.of(DeletePods)[0].names == (INSPECT,)  # its node and volumes freed for the training pod
    assert ModelArchitecture.model_validate(w.job["status"]["modelArchitecture"]) == LLAMA
    inspected = w.condition("Inspected")
    assert (inspected["status"], inspected["reason"]) == ("True", "ModelInspected")
    assert "32 layers, hidden 4096" in inspected["message"]
    assert any(e.reason == "ModelInspected" for e in w.events)

    # A retry plans with the stored shape; the deleted inspection pod is neither re-read nor a failed attempt.
    w.pods[names.pod_name("llama", 0)]["status"] = {"phase": "Failed"}
    retry = w.step()
    assert [a.architecture for a in retry.of(CreateAttempt)] == [LLAMA]
    assert not retry.of(CreateInspection)
    assert w.job["status"]["failedPods"] == [names.pod_name("llama", 0)]


def test_an_inspection_that_fails_fails_the_job_with_its_message():
    w = World()
    w.step()
    error = ("/models/Meta-Llama-3-8B-Instruct/config.json: no such file; model.path must be a Hugging Face model "
             "directory")
    w.inspection_ends(2, error)
    d = w.step()
    assert not d.of(CreateAttempt) and not d.of(CreateInspection)
    assert w.job["status"]["phase"] == "Failed"
    failed = w.condition("Failed")
    assert failed["reason"] == "ModelInspectionFailed" and error in failed["message"]
    assert "exit code 2" in failed["message"]
    assert not d.of(DeletePods)  # kept, for `kubectl logs`, until the job goes
    assert any(e.type == "Warning" and e.reason == "ModelInspectionFailed" for e in w.events)


def test_a_pod_that_ends_without_a_shape_fails_the_job():
    w = World()
    w.step()
    w.inspection_ends(0, "hello")
    w.step()
    failed = w.condition("Failed")
    assert failed["reason"] == "ModelInspectionFailed" and "without a model shape" in failed["message"]


def test_a_read_shape_that_does_not_suit_the_job_fails_it_naming_the_field():
    w = World()
    w.job["spec"]["training"]["sequenceLength"] = 4096
    w.step()
    w.inspection_ends(0, ModelArchitecture(family="gpt", layers=2, hidden=64, intermediate=256, heads=4, kv_heads=4,
                                           vocab=300, max_positions=1024).model_dump_json(by_alias=True))
    d = w.step()
    assert not d.of(CreateAttempt)
    failed = w.condition("Failed")
    assert failed["reason"] == "InvalidSpec"
    assert "sequenceLength (4096) exceeds the model's 1024 positions" in failed["message"]


def test_suspend_stops_the_inspection_and_resume_starts_it_again():
    w = World()
    w.step()
    w.pods[INSPECT]["status"] = {"phase": "Running"}
    w.job["spec"]["runPolicy"]["suspend"] = True
    d = w.step()
    assert d.of(DeletePods)[0].names == (INSPECT,) and w.job["status"]["phase"] == "Suspended"
    w.job["spec"]["runPolicy"]["suspend"] = False
    assert not w.step().of(CreateInspection)  # the old pod is still terminating: its name is the new one's
    del w.pods[INSPECT]
    assert w.step().of(CreateInspection)
    assert "failedPods" not in w.job["status"]


def test_a_job_that_states_its_shape_is_never_inspected():
    job = job_dict()
    job["metadata"]["finalizers"] = ["memstrata.dev/cleanup"]
    d = decide(job_view(job), [], at(0), lambda spec: place(spec, NODES, {}), LifecyclePolicy())
    assert not d.of(CreateInspection) and d.of(CreateAttempt)[0].architecture is None


def test_the_inspection_pod_reads_the_volumes_and_nothing_else():
    job = job_view(World(labels={"user.memstrata.dev/team": "nlp"}).job)
    pod = inspection.pod(job)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "llama-inspect-uid1" and meta["labels"][names.LABEL_ROLE] == names.ROLE_INSPECT
    assert meta["labels"][names.LABEL_JOB_UID] == "uid-1" and meta["labels"]["user.memstrata.dev/team"] == "nlp"
    assert meta["ownerReferences"][0]["uid"] == "uid-1" and names.LABEL_ATTEMPT not in meta["labels"]
    (c,) = spec["containers"]
    assert c["command"] == ["memstrata", "inspect-model", "/models/Meta-Llama-3-8B-Instruct"]
    assert c["image"] == job.spec.image and c["terminationMessagePolicy"] == "File"
    assert [(m["name"], m["mountPath"], m["readOnly"]) for m in c["volumeMounts"]] == [
        ("models", "/models", True), ("data", "/data", True), ("output", "/output", True)]
    assert spec["volumes"] == [v.model_dump(by_alias=True, exclude_none=True) for v in job.spec.volumes]
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
    assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] > 0
    assert spec["securityContext"]["runAsNonRoot"] and "supplementalGroups" not in spec["securityContext"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert pod_view(pod).inspection


def test_an_inspection_pod_the_scheduler_cannot_place_says_why_in_the_jobs_status():
    w = World()
    w.step()
    why = '0/3 nodes are available: persistentvolumeclaim "llama3-8b-weights" not found'
    w.pods[INSPECT]["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}]}
    d = w.step()
    assert not d.of(CreateInspection) and w.job["status"]["phase"] == "Pending"
    assert why in w.job["status"]["message"] and why in w.condition("Inspected")["message"]
