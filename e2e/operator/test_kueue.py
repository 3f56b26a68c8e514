"""FineTuneJobs queued by a real Kueue (e2e.kueue.peer: its controller built from its Go module, its CRDs and
webhooks as released) and the real operator running with --kueue, against the real API server.

- quota: a ClusterQueue of one GPU admits one of two jobs; the second waits, Queued in Kueue's words, with no pod
  and nothing else of its own; it runs once the first finishes. A job deleted while queued leaves nothing behind.
- a gang: a two-node job is admitted whole or not at all.
- preemption: a high-priority job preempts a running one (the real runtime, training for real on this CPU); the
  preempted job resumes from its latest checkpoint when Kueue admits it again, and succeeds.
Figures (time to admission, steps lost to the preemption) are printed.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from memstrata.api.units import quantity_value
from memstrata.operator import names
from memstrata.runtime.train.checkpoints.ckptstore import find_latest
from e2e.operator.harness import SUCCEED_LABEL, apply_yaml, events_of, example, ftj, job, pods_of, wait
from e2e.operator.runtimepod import CHECKPOINT_LINE, PROGRESS_LINE, Attempt, past_checkpoint, running_pod

pytestmark = [pytest.mark.cluster]

KUEUE = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
RESOURCES = ("nvidia.com/gpu", "memory", "memstrata.dev/nvme-ns", "memstrata.dev/cxl-gib")


def queues(cluster: Any, ns: str, quota: dict[str, Any], preemption: bool = False) -> str:
    """A ResourceFlavor, a ClusterQueue for `ns` alone (every resource a memstrata job requests covered: Kueue
    admits nothing that asks for an uncovered one) and LocalQueue `team` in `ns`; returns the ClusterQueue."""
    cq = f"cq-{ns}"
    limits = {r: 1000 for r in RESOURCES} | {"memory": "4Ti"} | quota
    cluster.apply({"apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": "default"}})
    cluster.apply({"apiVersion": KUEUE, "kind": "ClusterQueue", "metadata": {"name": cq}, "spec": {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
        "preemption": {"withinClusterQueue": "LowerPriority" if preemption else "Never"},
        "resourceGroups": [{"coveredResources": list(RESOURCES), "flavors": [{"name": "default", "resources": [
            {"name": r, "nominalQuota": limits[r]} for r in RESOURCES]}]}]}})
    cluster.apply({"apiVersion": KUEUE, "kind": "LocalQueue", "metadata": {"name": "team", "namespace": ns},
                   "spec": {"clusterQueue": cq}})
    return cq


@pytest.fixture
def cluster_queue(memstrata_cluster: Any, kueue: Any, ns: str) -> Any:
    made: list[str] = []
    yield lambda quota, preemption=False: made.append(queues(memstrata_cluster, ns, quota, preemption)) or made[-1]
    for cq in made:
        memstrata_cluster.kubectl("delete", "clusterqueue", cq, "--ignore-not-found", "--wait=false")


def workloads(cluster: Any, ns: str) -> list[dict[str, Any]]:
    return cluster.get_json("workloads.kueue.x-k8s.io", "-n", ns)["items"]


def workload_of(cluster: Any, ns: str, job_name: str) -> dict[str, Any] | None:
    uid = ftj(cluster, ns, job_name)["metadata"]["uid"]
    return next((w for w in workloads(cluster, ns) if w["metadata"]["labels"].get(names.LABEL_JOB_UID) == uid), None)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def queued(cluster: Any, ns: str, name: str, reason: str | None = None) -> dict[str, Any] | None:
    status = ftj(cluster, ns, name).get("status") or {}
    cond = next((c for c in status.get("conditions") or [] if c["type"] == "Queued"), {})
    ok = status.get("phase") == "Queued" and cond.get("status") == "True" and reason in (None, cond.get("reason"))
    return cond if ok else None


def phase(cluster: Any, ns: str, name: str) -> str:
    return (ftj(cluster, ns, name).get("status") or {}).get("phase", "")


def children_of(cluster: Any, ns: str, uid: str) -> list[str]:
    """Every object in `ns` the operator made for the job with this UID (its label)."""
    out = cluster.kubectl("get", "pods,configmaps,serviceaccounts,roles,rolebindings,services,"
                          "workloads.kueue.x-k8s.io", "-n", ns, "-l", names.selector(uid), "-o", "name")
    return out.split()


def test_quota_admits_one_of_two_and_the_second_runs_when_the_first_finishes(
        memstrata_cluster: Any, ns: str, nodes: Any, cluster_queue: Any) -> None:
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=1024, gpus=2)  # room for both: only the quota holds the second back
    cluster_queue({"nvidia.com/gpu": 1})
    on_queue = {QUEUE_LABEL: "team"}

    began = time.monotonic()
    apply_yaml(cluster, job("first", labels=on_queue), ns)
    (pod,) = wait("first's pod", lambda: pods_of(cluster, ns, "first") or None, timeout=60)
    first_admitted = time.monotonic() - began
    wl = workload_of(cluster, ns, "first")
    assert wl is not None and condition(wl, "Admitted").get("status") == "True", wl
    podset = wl["spec"]["podSets"][0]
    assert podset["count"] == 1 and wl["spec"]["queueName"] == "team"
    # The quota is what the pod asks for: its GPU, its memory limit (and nothing less).
    requests = podset["template"]["spec"]["containers"][0]["resources"]["requests"]
    asked = pod["spec"]["containers"][0]["resources"]["requests"]
    assert {r: int(v) for r, v in requests.items() if r != "memory"} == \
        {r: int(v) for r, v in asked.items() if r != "memory" and r != "cpu"}, (requests, asked)
    assert quantity_value(requests["memory"]) == quantity_value(asked["memory"]), (requests, asked)
    assert QUEUE_LABEL not in pod["metadata"]["labels"]  # queued once, through the Workload, never by itself
    # Kueue's waitForPodsReady (10 s here) would evict a Workload whose pods never report ready.
    wait("first's Workload PodsReady", lambda: condition(workload_of(cluster, ns, "first") or {}, "PodsReady")
         .get("status") == "True", timeout=30)

    apply_yaml(cluster, job("second", labels=on_queue), ns)
    waiting = wait("second Queued by Kueue", lambda: queued(cluster, ns, "second", "Pending"), timeout=60)
    time.sleep(12)  # past waitForPodsReady's timeout: the first, whose pod runs, is not evicted
    assert condition(workload_of(cluster, ns, "first") or {}, "Evicted").get("status") != "True"
    assert phase(cluster, ns, "first") == "Running"
    assert "insufficient unused quota for nvidia.com/gpu" in waiting["message"], waiting
    assert "LocalQueue team" in waiting["message"], waiting
    # (and nothing sneaked past the queue meanwhile)
    second_uid = ftj(cluster, ns, "second")["metadata"]["uid"]
    assert children_of(cluster, ns, second_uid) == [f"workload.kueue.x-k8s.io/{names.workload_name('second', second_uid)}"]
    row = cluster.kubectl("get", "ftj", "second", "-n", ns).splitlines()[1]
    assert " Queued " in row, row

    # A job deleted while it waits leaves nothing: its Workload goes with it.
    apply_yaml(cluster, job("third", labels=on_queue), ns)
    wait("third Queued", lambda: queued(cluster, ns, "third"), timeout=60)
    third_uid = ftj(cluster, ns, "third")["metadata"]["uid"]
    cluster.kubectl("delete", "ftj", "third", "-n", ns, "--wait=false")
    wait("third and all of its objects gone", lambda: not children_of(cluster, ns, third_uid) and not cluster.kubectl(
        "get", "ftj", "-n", ns, "--ignore-not-found", "-o", "name", "--field-selector", "metadata.name=third"),
        timeout=60)

    cluster.kubectl("label", "pod", pod["metadata"]["name"], "-n", ns, f"{SUCCEED_LABEL}=true")
    wait("first Succeeded", lambda: phase(cluster, ns, "first") == "Succeeded", timeout=60)
    finished_at = time.monotonic()
    wait("first's Workload Finished", lambda: condition(workload_of(cluster, ns, "first") or {}, "Finished")
         .get("status") == "True", timeout=30)
    (second_pod,) = wait("second's pod", lambda: pods_of(cluster, ns, "second") or None, timeout=60)
    second_admitted = time.monotonic() - finished_at
    # The operator creates the pod, then records the admission on the job: the condition may land a moment later.
    wait("second's Queued condition Admitted",
         lambda: condition(ftj(cluster, ns, "second"), "Queued").get("reason") == "Admitted", timeout=30)
    cluster.kubectl("label", "pod", second_pod["metadata"]["name"], "-n", ns, f"{SUCCEED_LABEL}=true")
    wait("second Succeeded", lambda: phase(cluster, ns, "second") == "Succeeded", timeout=60)
    print(f"\n[kueue] first job admitted and its pod created {first_admitted:.1f} s after submission; the second "
          f"(queued on a one-GPU quota) {second_admitted:.1f} s after the first finished")


def test_a_two_node_job_is_admitted_whole_or_not_at_all(memstrata_cluster: Any, ns: str, nodes: Any,
                                                       cluster_queue: Any) -> None:
    cluster = memstrata_cluster
    nodes.add("a", dram_gib=1024)
    nodes.add("b", dram_gib=1024)
    cq = cluster_queue({"nvidia.com/gpu": 1})
    apply_yaml(cluster, job("gang", labels={QUEUE_LABEL: "team"}, resources={"gpus": 1, "nodes": 2}), ns)
    waiting = wait("the gang Queued", lambda: queued(cluster, ns, "gang", "Pending"), timeout=60)
    assert "nvidia.com/gpu" in waiting["message"], waiting
    assert (workload_of(cluster, ns, "gang") or {})["spec"]["podSets"][0]["count"] == 2
    time.sleep(2)
    assert not pods_of(cluster, ns, "gang")  # not one pod of the two on a quota of one
    cluster.kubectl("patch", "clusterqueue", cq, "--type=json", "-p",
                    '[{"op": "replace", "path": "/spec/resourceGroups/0/flavors/0/resources/0/nominalQuota", '
                    '"value": 2}]')
    pods = wait("both pods of the gang", lambda: (p := pods_of(cluster, ns, "gang")) and len(p) == 2 and p, timeout=60)
    assert sorted(p["spec"]["nodeName"] if p["spec"].get("nodeName") else p["metadata"]["name"] for p in pods)


def _steps(lines: list[str], pattern: Any) -> list[int]:
    return [int(m[1]) for line in lines if (m := pattern.match(line))]


@pytest.mark.slow
def test_preempted_by_a_higher_priority_job_it_resumes_from_its_checkpoint(
        memstrata_cluster: Any, ns: str, nodes: Any, cluster_queue: Any, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: run `make install`")
    cluster = memstrata_cluster
    nodes.add("cpu", dram_gib=64)  # two namespaces: only the quota of one makes the jobs contend
    low, high = f"low-{ns}", f"high-{ns}"
    for name, value in ((low, 10), (high, 1000)):
        cluster.apply({"apiVersion": KUEUE, "kind": "WorkloadPriorityClass", "metadata": {"name": name},
                       "value": value, "description": "e2e"})
    cluster_queue({"memstrata.dev/nvme-ns": 1}, preemption=True)
    steps, every = 16, 2
    ckpt = tmp_path / "ckpt"
    doc = example("finetune-tiny.yaml")
    doc["metadata"] = {"name": "long", "labels": {QUEUE_LABEL: "team", PRIORITY_LABEL: low}}
    doc["spec"]["training"]["steps"] = steps
    doc["spec"]["checkpoint"] = {"path": str(ckpt), "everySteps": every}
    began = time.monotonic()
    apply_yaml(cluster, doc, ns)
    attempts: list[Attempt] = []
    try:
        first = Attempt(cluster, ns, running_pod(cluster, ns, "long", 0), tmp_path / "attempt-0").start()
        attempts.append(first)
        admitted = time.monotonic() - began
        assert (workload_of(cluster, ns, "long") or {})["spec"]["priority"] == 10
        first.wait_output("a step after a checkpoint at step >= 4", past_checkpoint(4), timeout=240)

        urgent = example("finetune-tiny.yaml")
        urgent["metadata"] = {"name": "urgent", "labels": {QUEUE_LABEL: "team", PRIORITY_LABEL: high,
                                                            SUCCEED_LABEL: "true"}}
        submitted = time.monotonic()
        apply_yaml(cluster, urgent, ns)

        def stopped() -> bool:
            pod = next((p for p in pods_of(cluster, ns, "long") if p["metadata"]["name"] == first.name), None)
            return pod is None or bool(pod["metadata"].get("deletionTimestamp"))

        wait("the long job's pod deleted (preempted)", stopped, timeout=60)
        preempted_in = time.monotonic() - submitted
        first.signal(signal.SIGTERM)  # what the kubelet does to a deleted pod's container
        rc = first.finish(timeout=120)
        assert rc != 0, f"{first.name} finished before it was preempted:\n{first.tail()}"
        last_step = max(_steps(first.lines, PROGRESS_LINE))
        # The store, not the lines, says where the resume starts: SIGTERM may land after a checkpoint is committed
        # and before its line is printed (a CI-mode run saw 6 committed, 4 the last reported; it resumed at 7).
        found = find_latest(ckpt)
        assert found is not None, first.tail()
        last_ckpt = found.manifest.step
        assert last_ckpt >= max(_steps(first.lines, CHECKPOINT_LINE)), (last_ckpt, first.tail())
        assert last_step < steps, first.tail()
        # Told as it happened (the condition moves on to Kueue's Pending once the admission is cleared).
        told = wait("a Preempted warning for long", lambda: next((e for e in events_of(cluster, ns, "long")
                                                                  if (e["reason"], e["type"]) == ("Preempted", "Warning")),
                                                                 None), timeout=60)
        assert "Queued=True: evicted by Kueue (Preempted)" in told["message"], told
        wait("urgent Succeeded", lambda: phase(cluster, ns, "urgent") == "Succeeded", timeout=90)
        urgent_done = time.monotonic()

        second = Attempt(cluster, ns, running_pod(cluster, ns, "long", 1), tmp_path / "attempt-1").start()
        attempts.append(second)
        readmitted = time.monotonic() - urgent_done
        assert second.finish(timeout=300) == 0, second.tail()
        resumed = _steps(second.lines, PROGRESS_LINE)
        assert resumed[0] - 1 == last_ckpt and resumed[-1] == steps, (last_ckpt, resumed)
        assert f"(step {last_ckpt} of {steps})" in "\n".join(second.lines), second.tail()
        cluster.kubectl("label", "pod", second.name, "-n", ns, f"{SUCCEED_LABEL}=true")
        wait("long Succeeded", lambda: phase(cluster, ns, "long") == "Succeeded", timeout=60)
    finally:
        for a in attempts:
            a.kill()
            print(f"[{a.name}] runtime log: {a.work / 'runtime.log'}")
    status = ftj(cluster, ns, "long")["status"]
    assert status["progress"]["resumedFrom"] == last_ckpt and status["attempts"] == 2, status
    assert not status.get("failedPods") and not status.get("restarts"), status  # a preemption is no failure
    warnings = [e for e in events_of(cluster, ns, "long") if e["type"] == "Warning"]
    assert [e["reason"] for e in warnings] == ["Preempted"], warnings
    lost = max(0, last_step - last_ckpt)  # a checkpoint committed but unreported can be past the last line
    assert lost <= every, (last_step, last_ckpt)
    print(f"\n[kueue] preemption: the low-priority job was admitted {admitted:.1f} s after submission; a "
          f"high-priority job had its pod deleted {preempted_in:.1f} s after it was submitted; steps lost: {lost} "
          f"(it had run to step {last_step}, resumed from checkpoint {last_ckpt}, every {every}); re-admitted "
          f"{readmitted:.1f} s after the high-priority job finished")


def test_the_queued_example_is_admitted_onto_its_flavors_nodes_only(memstrata_cluster: Any, kueue: Any,
                                                                    operator: Any, nodes: Any) -> None:
    """examples/finetune-queued.yaml applied whole, as its header says (Kueue's webhooks check its queues): the job
    gets its priority class's value and runs on the node with the flavor's label, never on the other."""
    import yaml

    cluster = memstrata_cluster
    docs = [d for d in yaml.safe_load_all((Path(__file__).resolve().parents[2] / "examples" /
                                           "finetune-queued.yaml").read_text()) if d]
    job_doc = next(d for d in docs if d["kind"] == "FineTuneJob")
    ns, name = job_doc["metadata"]["namespace"], job_doc["metadata"]["name"]
    flavor = next(d for d in docs if d["kind"] == "ResourceFlavor")["spec"]["nodeLabels"]
    plain = nodes.add("any", dram_gib=1024)  # holds the job, and sorts first (placement's last tie-break), but is
    # not of the flavor
    h100 = nodes.add("h100", dram_gib=1024)
    cluster.kubectl("label", "node", h100, *(f"{k}={v}" for k, v in flavor.items()))
    cluster.create_namespace(ns)
    try:
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        (pod,) = wait(f"{name}'s pod", lambda: pods_of(cluster, ns, name) or None, timeout=60)
        wl = workload_of(cluster, ns, name)
        assert wl is not None and wl["spec"]["priority"] == 100 and wl["spec"]["queueName"] == "ml-team", wl
        assert (pod["spec"].get("nodeName") or str(pod["spec"].get("affinity"))).count(h100) >= 1, pod["spec"]
        assert plain not in str(pod["spec"].get("nodeName")) + str(pod["spec"].get("affinity")), pod["spec"]
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false")
        cluster.wait_for(f"pods of {ns} gone", lambda: not cluster.get_json("pods", "-n", ns)["items"], timeout=120)
        cluster.kubectl("delete", "--ignore-not-found", "--wait=false", *(
            f"{d['kind'].lower()}.kueue.x-k8s.io/{d['metadata']['name']}" for d in docs
            if d["apiVersion"].startswith("kueue") and "namespace" not in d["metadata"]))
