"""A FineTuneJob's life against the real control plane: kwok plays the kubelet and the runtime's
exit (stages), `memstrata operator` runs as a real process."""
from __future__ import annotations

import json
import subprocess

import pytest

from e2e.cluster.kwok import FAIL_LABEL
from memstrata.operator import names
from e2e.operator.harness import (
    REPO, SUCCEED_LABEL, apply_yaml, events_of, ftj, job, pods_of, wait,
)

pytestmark = pytest.mark.cluster


def phase(cluster, ns, name):
    return (ftj(cluster, ns, name).get("status") or {}).get("phase")


def condition(obj, type_):
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), None)


def test_example_lands_on_the_node_with_fewest_bytes_on_slow_strata(memstrata_cluster, ns, nodes, example_claims):
    cluster = memstrata_cluster
    dram = nodes.add("gpu-dram", dram_gib=1024)
    nodes.add("gpu-cxl", dram_gib=512, cxl_gib=256)
    nodes.add("gpu-small", dram_gib=128)
    cluster.kubectl("apply", "-n", ns, "-f", str(REPO / "examples" / "finetune.yaml"))
    wait("llama3-8b-32k Running", lambda: phase(cluster, ns, "llama3-8b-32k") == "Running")
    (pod,) = pods_of(cluster, ns, "llama3-8b-32k")
    assert pod["spec"]["nodeName"] == dram  # bound by the real scheduler, through the affinity we set
    resources = pod["spec"]["containers"][0]["resources"]
    # The plan's DRAM for the pod (render.memory_bytes) is both request and limit: the kubelet enforces it.
    assert resources["limits"] == resources["requests"] and set(resources["limits"]) == {"nvidia.com/gpu", "memory"}
    assert resources["limits"]["nvidia.com/gpu"] == "1"
    job_obj = ftj(cluster, ns, "llama3-8b-32k")
    assert job_obj["status"]["node"] == dram and job_obj["status"]["plan"]["feasible"] is True
    cm = cluster.get_json("configmap", names.configmap_name("llama3-8b-32k", job_obj["metadata"]["uid"]), "-n", ns)
    config = json.loads(cm["data"]["runtime-config.json"])
    assert config["node"] == dram and config["job"]["uid"] == job_obj["metadata"]["uid"]
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("FineTuneJob", job_obj["metadata"]["uid"], True)
    table = cluster.kubectl("get", "ftj", "-n", ns)
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "PHASE", "NODE", "PROGRESS", "ETA", "CHECKPOINT", "AGE"]
    assert row.split()[:3] == ["llama3-8b-32k", "Running", dram]


def test_cxl_node_is_chosen_over_nvme_spill_and_its_memory_requested(memstrata_cluster, ns, nodes, example_claims):
    cluster = memstrata_cluster
    cxl = nodes.add("gpu-cxl", dram_gib=512, cxl_gib=256)
    nodes.add("gpu-small", dram_gib=128)
    cluster.kubectl("apply", "-n", ns, "-f", str(REPO / "examples" / "finetune.yaml"))
    wait("Running", lambda: phase(cluster, ns, "llama3-8b-32k") == "Running")
    (pod,) = pods_of(cluster, ns, "llama3-8b-32k")
    assert pod["spec"]["nodeName"] == cxl
    assert pod["spec"]["containers"][0]["resources"]["requests"]["memstrata.dev/cxl-gib"] == "23"


def test_job_succeeds_with_a_condition_and_an_event_per_transition(memstrata_cluster, ns, nodes):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("tiny", labels={SUCCEED_LABEL: "true"}), ns)
    wait("tiny Succeeded", lambda: phase(cluster, ns, "tiny") == "Succeeded", timeout=60)
    obj = ftj(cluster, ns, "tiny")
    assert condition(obj, "Succeeded")["status"] == "True" and condition(obj, "Running")["status"] == "False"
    assert obj["status"]["completionTime"] and obj["status"]["startTime"]
    reasons = wait("events posted", lambda: [e["reason"] for e in events_of(cluster, ns, "tiny")]
                   if len(events_of(cluster, ns, "tiny")) >= 4 else None)
    for r in ("PodCreated", "PodScheduled", "PodRunning", "PodSucceeded"):
        assert r in reasons, reasons
    assert len(pods_of(cluster, ns, "tiny")) == 1


def test_failing_pods_are_retried_exactly_backoff_limit_times(memstrata_cluster, ns, nodes):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("crashy", labels={FAIL_LABEL: "3"}, run_policy={"backoffLimit": 2}), ns)
    wait("crashy Failed", lambda: phase(cluster, ns, "crashy") == "Failed", timeout=90)
    obj = ftj(cluster, ns, "crashy")
    failed = condition(obj, "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "exit code 3" in failed["message"]
    assert obj["status"]["failedPods"] == ["crashy-0", "crashy-1", "crashy-2"]
    pods = pods_of(cluster, ns, "crashy")
    assert [p["metadata"]["name"] for p in pods] == ["crashy-0", "crashy-1", "crashy-2"]
    assert {p["status"]["phase"] for p in pods} == {"Failed"}
    reasons = [e["reason"] for e in events_of(cluster, ns, "crashy")]
    assert "BackoffAfterFailure" in reasons and "BackoffLimitExceeded" in reasons
    subprocess.run(["sleep", "4"], check=True)  # longer than the next backoff would be
    assert len(pods_of(cluster, ns, "crashy")) == 3


def test_suspend_removes_pods_and_resume_recreates_them(memstrata_cluster, ns, nodes):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("pausable"), ns)
    wait("Running", lambda: phase(cluster, ns, "pausable") == "Running")
    cluster.kubectl("patch", "ftj", "pausable", "-n", ns, "--type=merge", "-p",
                    '{"spec":{"runPolicy":{"suspend":true}}}')
    wait("Suspended", lambda: phase(cluster, ns, "pausable") == "Suspended")
    wait("pods removed", lambda: not pods_of(cluster, ns, "pausable"))
    obj = ftj(cluster, ns, "pausable")
    assert condition(obj, "Suspended")["status"] == "True" and "startTime" not in obj["status"]
    cluster.kubectl("patch", "ftj", "pausable", "-n", ns, "--type=merge", "-p",
                    '{"spec":{"runPolicy":{"suspend":false}}}')
    wait("Running again", lambda: phase(cluster, ns, "pausable") == "Running")
    (pod,) = pods_of(cluster, ns, "pausable")
    assert pod["metadata"]["name"] == "pausable-1"
    obj = ftj(cluster, ns, "pausable")
    assert condition(obj, "Suspended")["reason"] == "Resumed" and "failedPods" not in obj["status"]


def test_a_checkpoint_and_a_resume_are_each_announced_once(memstrata_cluster, ns, nodes):
    """The runtime reports a checkpoint (and, in a later attempt, that it resumed) into the job's status; the
    operator posts one event for each, however many progress reports follow."""
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("saver", checkpoint={"path": "/output/ckpt", "everySteps": 10}), ns)
    wait("Running", lambda: phase(cluster, ns, "saver") == "Running")

    def report(status):  # as the runtime's token would (the status policy only binds ServiceAccounts)
        cluster.kubectl("patch", "ftj", "saver", "-n", ns, "--subresource=status", "--type=merge",
                        "-p", json.dumps({"status": status}))

    def told(reason):
        return [e for e in events_of(cluster, ns, "saver") if e["reason"] == reason]

    ckpt = {"path": "/output/ckpt/step-00000010", "step": 10, "time": "2026-01-01T12:00:00Z",
            "bytes": 3 << 30, "seconds": 2.5}
    report({"checkpoint": ckpt, "progress": {"step": 10, "total": 40, "attempt": 0}})
    (event,) = wait("Checkpointed", lambda: told("Checkpointed"))
    assert event["type"] == "Normal"
    assert event["message"] == "step 10 written to /output/ckpt/step-00000010 in 2.5s, 3.0 GiB"
    for step in (11, 12, 13):
        report({"progress": {"step": step, "total": 40, "attempt": 0}})
    report({"progress": {"step": 12, "total": 40, "attempt": 0, "resumedFrom": 10}})
    wait("Resumed", lambda: told("Resumed"))
    subprocess.run(["sleep", "2"], check=True)  # time for any (wrong) repeat to be posted
    assert [e["count"] for e in told("Checkpointed")] == [1]
    assert [e["message"] for e in told("Resumed")] == ["attempt 1 resumed from checkpoint step 10"]
    obj = ftj(cluster, ns, "saver")
    assert (obj["status"]["announcedCheckpoint"], obj["status"]["announcedResume"]) == (10, 0)
    table = cluster.kubectl("get", "ftj", "saver", "-n", ns)
    header, row = table.splitlines()[:2]
    assert row[header.index("CHECKPOINT"):header.index("AGE")].strip() == "10", table


def test_deleting_a_job_removes_every_child(memstrata_cluster, ns, nodes):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("doomed"), ns)
    wait("Running", lambda: phase(cluster, ns, "doomed") == "Running")
    uid = ftj(cluster, ns, "doomed")["metadata"]["uid"]
    assert "memstrata.dev/cleanup" in ftj(cluster, ns, "doomed")["metadata"]["finalizers"]
    cluster.kubectl("delete", "ftj", "doomed", "-n", ns, "--timeout=60s")
    left = cluster.kubectl("get", "pods,configmaps,serviceaccounts,roles,rolebindings", "-n", ns,
                           "-l", f"memstrata.dev/job-uid={uid}", "-o", "name")
    assert left.strip() == ""
    assert cluster.kubectl("get", "ftj", "-n", ns, "-o", "name").strip() == ""


def test_active_deadline_fails_the_job(memstrata_cluster, ns, nodes):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("slow", run_policy={"activeDeadlineSeconds": 3}), ns)
    wait("Failed", lambda: phase(cluster, ns, "slow") == "Failed", timeout=30)
    assert condition(ftj(cluster, ns, "slow"), "Failed")["reason"] == "DeadlineExceeded"
    wait("pod removed", lambda: not pods_of(cluster, ns, "slow"))


def test_ttl_after_finished_deletes_the_job(memstrata_cluster, ns, nodes):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("brief", labels={SUCCEED_LABEL: "true"}, run_policy={"ttlSecondsAfterFinished": 2}), ns)
    wait("job deleted after its TTL", lambda: cluster.get_json("ftj", "-n", ns)["items"] == [], timeout=60)
