"""The job's volumes in its pods, and the model inspection pod, against the real control plane.

The pods are the ones the real API server accepted (and the real scheduler bound to a kwok node); kwok runs
no containers, so the inspection pod's end is written into its status as the kubelet writes it — phase,
exit code and the container's termination message.
"""
from __future__ import annotations

import json
from typing import Any

import pytest

from memstrata.api.architecture import PRESETS, ModelArchitecture
from memstrata.operator import names
from e2e.operator.harness import apply_yaml, events_of, example, ftj, pods_of, wait

pytestmark = pytest.mark.cluster

NAME = "llama3-8b-32k"


def _status(cluster: Any, ns: str, name: str = NAME) -> dict[str, Any]:
    return ftj(cluster, ns, name).get("status") or {}


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


def _training_pod(cluster: Any, ns: str) -> dict[str, Any] | None:
    return next((p for p in pods_of(cluster, ns, NAME) if names.LABEL_ROLE not in p["metadata"]["labels"]), None)


def _inspection_pod(cluster: Any, ns: str) -> dict[str, Any] | None:
    return next((p for p in pods_of(cluster, ns, NAME) if names.LABEL_ROLE in p["metadata"]["labels"]), None)


def _mounts(pod: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """mountPath -> (the claim behind it, read-only), for the container's mounts of claims."""
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    (c,) = pod["spec"]["containers"]
    return {m["mountPath"]: (claims[m["name"]], bool(m.get("readOnly")))
            for m in c["volumeMounts"] if m["name"] in claims}


def _end_inspection(cluster: Any, ns: str, pod: dict[str, Any], exit_code: int, message: str) -> None:
    """What the kubelet writes when the container exits (kwok never runs it)."""
    now = "2026-11-23T08:00:00Z"
    status = {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [{
        "name": names.INSPECT_CONTAINER, "image": pod["spec"]["containers"][0]["image"], "imageID": "", "ready": False,
        "restartCount": 0, "started": False, "state": {"terminated": {
            "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "message": message,
            "startedAt": now, "finishedAt": now}}}]}
    cluster.kubectl("patch", "pod", pod["metadata"]["name"], "-n", ns, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": status}))


def test_the_examples_volumes_are_mounted_where_the_job_says(memstrata_cluster, ns, nodes, example_claims):
    cluster = memstrata_cluster
    node = nodes.add("gpu", dram_gib=1024)
    apply_yaml(cluster, example("finetune.yaml"), ns)
    pod = wait("the training pod bound", lambda: (p := _training_pod(cluster, ns)) and p["spec"].get("nodeName") and p)
    assert pod["spec"]["nodeName"] == node
    assert _mounts(pod) == {"/models": ("llama3-8b-weights", True), "/data": ("chat-data", True),
                            "/output": ("finetune-output", False)}
    (c,) = pod["spec"]["containers"]
    config_mount = next(m for m in c["volumeMounts"] if m["name"] == names.CONFIG_VOLUME)
    assert config_mount["mountPath"] == names.CONFIG_MOUNT  # the operator's own mount is still there
    cm = cluster.get_json("configmap", names.configmap_name(NAME, ftj(cluster, ns, NAME)["metadata"]["uid"]), "-n", ns)
    config = json.loads(cm["data"]["runtime-config.json"])
    assert config["spec"]["output"]["path"] == "/output/llama3-8b-32k-chat" and config["spec"]["dataset"]["format"] == "messages"
    assert _inspection_pod(cluster, ns) is None  # the shape is stated: nothing to read first


def test_a_volume_the_api_server_refuses_fails_the_job_once_naming_the_field(memstrata_cluster, ns, nodes):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=1024)
    doc = example("finetune.yaml")
    doc["spec"]["volumes"][0] = {"name": "models", "persistentVolumeClaim": {"readOnly": True}}  # no claimName
    apply_yaml(cluster, doc, ns)
    wait("Failed", lambda: _status(cluster, ns).get("phase") == "Failed")
    failed = _condition(_status(cluster, ns), "Failed")
    assert failed["reason"] == "PodRejected", failed
    # The pod's volumes are the job's, in the job's order: the API server's field is the job's field.
    assert "spec.volumes[0].persistentVolumeClaim.claimName: Required value" in failed["message"], failed
    assert pods_of(cluster, ns, NAME) == []
    reasons = [e["reason"] for e in events_of(cluster, ns, NAME)]
    assert "PodRejected" in reasons and "ReconcileError" not in reasons, reasons  # one clear failure, no retry loop


def _architectureless(cluster: Any, ns: str) -> dict[str, Any]:
    doc = example("finetune.yaml")
    del doc["spec"]["model"]["architecture"]
    apply_yaml(cluster, doc, ns)
    return wait("the inspection pod", lambda: _inspection_pod(cluster, ns))


def test_the_operator_reads_the_model_shape_with_a_pod_then_plans_with_it(memstrata_cluster, ns, nodes,
                                                                           example_claims):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=1024)
    pod = _architectureless(cluster, ns)
    uid = ftj(cluster, ns, NAME)["metadata"]["uid"]
    assert pod["metadata"]["name"] == names.inspect_pod_name(NAME, uid)
    assert pod["metadata"]["ownerReferences"][0]["uid"] == uid
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["memstrata", "inspect-model", "/models/Meta-Llama-3-8B-Instruct"]
    assert _mounts(pod) == {"/models": ("llama3-8b-weights", True), "/data": ("chat-data", True),
                            "/output": ("finetune-output", True)}  # it only reads
    # The operator creates the pod before its status patch lands: wait for the patch, then check what it says.
    status = wait("the job's status recorded", lambda: (s := _status(cluster, ns)).get("phase") and s)
    assert status["phase"] == "Pending" and _condition(status, "Inspected")["reason"] == "Inspecting"
    assert _training_pod(cluster, ns) is None  # nothing is planned before the shape is known

    wait("the inspection pod bound", lambda: (p := _inspection_pod(cluster, ns)) and p["spec"].get("nodeName"))
    llama = PRESETS["llama3-8b"]
    _end_inspection(cluster, ns, pod, 0, llama.model_dump_json(by_alias=True))
    training = wait("the training pod", lambda: _training_pod(cluster, ns))
    status = wait("the plan recorded", lambda: (s := _status(cluster, ns)).get("plan") and s)
    assert ModelArchitecture.model_validate(status["modelArchitecture"]) == llama
    assert _condition(status, "Inspected")["reason"] == "ModelInspected"
    assert status["plan"]["parameters"] == 8_030_261_248
    wait("the inspection pod deleted", lambda: _inspection_pod(cluster, ns) is None)
    assert "ModelInspected" in [e["reason"] for e in events_of(cluster, ns, NAME)]
    # The runtime gets the shape the operator read, so its check against config.json holds.
    cm = cluster.get_json("configmap", names.configmap_name(NAME, uid), "-n", ns)
    model = json.loads(cm["data"]["runtime-config.json"])["spec"]["model"]
    assert ModelArchitecture.model_validate(model["architecture"]) == llama
    assert _mounts(training)["/output"] == ("finetune-output", False)


def test_a_model_directory_that_cannot_be_read_fails_the_job_with_the_reason(memstrata_cluster, ns, nodes,
                                                                            example_claims):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=1024)
    pod = _architectureless(cluster, ns)
    wait("the inspection pod bound", lambda: (p := _inspection_pod(cluster, ns)) and p["spec"].get("nodeName"))
    error = "/models/Meta-Llama-3-8B-Instruct/config.json: not valid JSON: Expecting value at line 1, column 1"
    _end_inspection(cluster, ns, pod, 2, error)
    wait("Failed", lambda: _status(cluster, ns).get("phase") == "Failed")
    failed = _condition(_status(cluster, ns), "Failed")
    assert failed["reason"] == "ModelInspectionFailed" and error in failed["message"], failed
    assert _training_pod(cluster, ns) is None
