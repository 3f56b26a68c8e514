"""What the user sees for jobs that cannot run: rejected at the API server (bad manifests), failed at
once (no node could ever hold it), or waiting (no node has room now)."""
from __future__ import annotations

import json
import subprocess

import pytest

from e2e.operator.harness import REPO, apply_yaml, events_of, example, ftj, job, pods_of, wait

pytestmark = pytest.mark.cluster


def _bad(mutate):
    doc = job("bad")
    mutate(doc["spec"])
    return doc


INVALID = [
    (lambda s: s.update(output={"path": "/out/m"}, checkpoint={"path": "/out/m/ckpt"}),
     "checkpoint.path must not be output.path or inside it"),
    (lambda s: s["training"].update(steps=10, schedule={"type": "cosine", "warmupSteps": 20}),
     "schedule.warmupSteps must not exceed training.steps"),
    (lambda s: s["training"].update(schedule={"warmupSteps": 2, "warmupRatio": 0.1}),
     "schedule: set warmupSteps or warmupRatio, not both"),
    (lambda s: s.update(output={"path": "/out/m", "metricsPath": "/out/m/logs"}),
     "output.metricsPath must not be output.path or inside it"),
    (lambda s: s["training"].update(optimizer={"beta2": 1.0}), "spec.training.optimizer.beta2"),
    (lambda s: s["training"].update(lora={"rank": 4}), "training.lora is only for training.method: lora"),
    (lambda s: s["training"].update(method="lora", lora={"rank": 0}), "spec.training.lora.rank"),
    (lambda s: s["training"].update(method="lora", lora={"dropout": 1.0}), "spec.training.lora.dropout"),
    (lambda s: s["training"].update(method="lora", lora={"targetModules": ["q_proj", "q_proj"]}),
     "spec.training.lora.targetModules[1]: Duplicate value"),
    (lambda s: s["training"].update(steps=0), "spec.training.steps"),
    (lambda s: s["model"].update(path="/models/x"), "set exactly one of model.preset or model.path"),
    (lambda s: s["training"].update(sequenceLength=1 << 16), "training.sequenceLength"),
    (lambda s: s["runPolicy"].update(backoffLimit=-1), "spec.runPolicy.backoffLimit"),
    (lambda s: s["training"].update(gradientAccumulaton=4), 'unknown field "spec.training.gradientAccumulaton"'),
    (lambda s: s["memory"].update(engine="zero-infinity"), "spec.memory.engine"),
    (lambda s: s["training"].update(layerMajor=True, gradientAccumulation=1),
     "training.layerMajor needs memory.engine memstrata, gradientAccumulation > 1"),
    (lambda s: (s["training"].update(update="delayed"), s["memory"].update(engine="deepspeed")),
     "training.update delayed needs memory.engine memstrata"),
    (lambda s: s["training"].update(update="later"), "spec.training.update"),
    (lambda s: s.update(volumes=[{"name": "runtime-config", "emptyDir": {}}]),
     "name must not be runtime-config: the operator's own volume"),
    (lambda s: s.update(volumes=[{"name": "data", "emptyDir": {}}],
                        volumeMounts=[{"name": "models", "mountPath": "/models"}]),
     "every volumeMounts[].name must be one of spec.volumes[].name"),
    (lambda s: s.update(volumes=[{"name": "data", "emptyDir": {}}],
                        volumeMounts=[{"name": "data", "mountPath": "/etc/memstrata"}]),
     "mountPath must not be at or under /etc/memstrata"),
    (lambda s: s.update(volumes=[{"name": "data", "emptyDir": {}}, {"name": "data", "hostPath": {"path": "/d"}}]),
     "spec.volumes[1]: Duplicate value"),
]


@pytest.mark.parametrize("mutate,field", INVALID, ids=[f for _, f in INVALID])
def test_invalid_manifest_is_rejected_naming_the_field_and_nothing_is_created(memstrata_cluster, ns, mutate, field):
    cluster = memstrata_cluster
    proc = subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "apply",
                           "-n", ns, "-f", "-"], input=json.dumps(_bad(mutate)), capture_output=True, text=True)
    assert proc.returncode != 0, proc.stdout
    assert field in proc.stderr, proc.stderr
    assert cluster.kubectl("get", "ftj,pods,configmaps", "-n", ns, "-o", "name",
                           "-l", "app.kubernetes.io/managed-by=memstrata-operator").strip() == ""
    assert cluster.kubectl("get", "ftj", "-n", ns, "-o", "name").strip() == ""


def test_spec_is_immutable_after_creation(memstrata_cluster, ns, nodes):
    cluster = memstrata_cluster
    apply_yaml(cluster, job("fixed", run_policy={"suspend": True}), ns)
    proc = subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "patch",
                           "ftj", "fixed", "-n", ns, "--type=merge", "-p", '{"spec":{"training":{"steps":7}}}'],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "immutable" in proc.stderr
    # The volumes too: the shape read from the model directory is the volumes' as created.
    proc = subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "patch",
                           "ftj", "fixed", "-n", ns, "--type=merge", "-p",
                           '{"spec":{"volumes":[{"name":"data","emptyDir":{}}]}}'], capture_output=True, text=True)
    assert proc.returncode != 0 and "immutable" in proc.stderr, proc.stderr


def test_a_job_no_node_can_ever_hold_fails_with_the_shortfall_per_stratum(memstrata_cluster, ns, nodes):
    cluster = memstrata_cluster
    small = nodes.add("small", dram_gib=64, nvme=0)
    cluster.kubectl("apply", "-n", ns, "-f", str(REPO / "examples" / "finetune.yaml"))
    wait("Failed", lambda: (ftj(cluster, ns, "llama3-8b-32k").get("status") or {}).get("phase") == "Failed")
    status = ftj(cluster, ns, "llama3-8b-32k")["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InsufficientMemory"
    assert f"closest is {small}" in failed["message"] and "NVMe short by" in failed["message"]
    assert [s["stratum"] for s in status["shortfalls"]] == ["nvme"]
    assert status["shortfalls"][0]["missingBytes"] > 70 * 2**30
    assert pods_of(cluster, ns, "llama3-8b-32k") == []
    warnings = [e for e in events_of(cluster, ns, "llama3-8b-32k") if e["type"] == "Warning"]
    assert any(e["reason"] == "InsufficientMemory" for e in warnings)


def test_waits_unschedulable_and_is_scheduled_when_capacity_frees(memstrata_cluster, ns, nodes):
    cluster = memstrata_cluster
    only = nodes.add("one-gpu", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("first"), ns)
    wait("first Running", lambda: (ftj(cluster, ns, "first").get("status") or {}).get("phase") == "Running")
    apply_yaml(cluster, job("second"), ns)
    wait("second Pending", lambda: (ftj(cluster, ns, "second").get("status") or {}).get("phase") == "Pending")
    status = ftj(cluster, ns, "second")["status"]
    scheduled = next(c for c in status["conditions"] if c["type"] == "Scheduled")
    assert scheduled["status"] == "False" and scheduled["reason"] == "Unschedulable"
    assert "nvidia.com/gpu needs 1, 0 free" in scheduled["message"] and only in scheduled["message"]
    assert pods_of(cluster, ns, "second") == []
    cluster.kubectl("delete", "ftj", "first", "-n", ns, "--wait=false")
    wait("second Running once the first's GPU is free",
         lambda: (ftj(cluster, ns, "second").get("status") or {}).get("phase") == "Running", timeout=30)
    assert pods_of(cluster, ns, "second")[0]["spec"]["nodeName"] == only


def test_examples_apply_cleanly(memstrata_cluster, ns):
    cluster = memstrata_cluster
    for name in ("finetune.yaml", "finetune-tiny.yaml", "finetune-chat-lora.yaml"):
        doc = example(name)
        doc["spec"]["runPolicy"] = {**doc["spec"].get("runPolicy", {}), "suspend": True}  # accepted, not run
        out = cluster.kubectl("apply", "--dry-run=server", "-n", ns, "-f", "-", input=json.dumps(doc))
        assert "created (server dry run)" in out
    # Stored as written: the volume sources, which the schema does not spell out, are not pruned.
    doc = example("finetune.yaml")
    doc["spec"]["runPolicy"]["suspend"] = True
    apply_yaml(cluster, doc, ns)
    stored = ftj(cluster, ns, doc["metadata"]["name"])["spec"]
    assert stored["volumes"] == doc["spec"]["volumes"] and stored["volumeMounts"][0]["readOnly"] is True
    assert stored["output"]["path"] == doc["spec"]["output"]["path"] and "architecture" in stored["model"]


def test_a_model_path_without_architecture_is_accepted(memstrata_cluster, ns):
    cluster = memstrata_cluster
    doc = example("finetune.yaml")
    del doc["spec"]["model"]["architecture"]
    doc["spec"]["runPolicy"]["suspend"] = True
    out = cluster.kubectl("apply", "--dry-run=server", "-n", ns, "-f", "-", input=json.dumps(doc))
    assert "created (server dry run)" in out
