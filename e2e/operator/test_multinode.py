"""A FineTuneJob on several nodes (spec.resources.nodes) against the real control plane: kwok plays the
kubelets, `memstrata operator` runs as a real process. Its pods get stable DNS names through a headless
Service, each pod's status report lands in its own status.workers entry, and one lost pod fails (and
restarts) the whole attempt."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from e2e.operator.harness import (apply_yaml, events_of, ftj, job, kubectl_as, one_pod_quota, pods_of, token_kubeconfig,
                                  wait)
from memstrata.api.runtimeconfig import RENDEZVOUS_PORT
from memstrata.operator import names

pytestmark = pytest.mark.cluster


def _status(cluster: Any, ns: str, name: str) -> dict[str, Any]:
    return ftj(cluster, ns, name).get("status") or {}


def _env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def _live(cluster: Any, ns: str, name: str, attempt: int) -> list[dict[str, Any]]:
    return sorted((p for p in pods_of(cluster, ns, name)
                   if p["metadata"]["labels"][names.LABEL_ATTEMPT] == str(attempt)
                   and not p["metadata"].get("deletionTimestamp")), key=lambda p: p["metadata"]["name"])


def _running_pair(cluster: Any, ns: str, name: str, attempt: int) -> list[dict[str, Any]]:
    try:
        return wait(f"{name}: attempt {attempt}'s 2 pods Running", lambda: (
            pods if len(pods := _live(cluster, ns, name, attempt)) == 2
            and all((p.get("status") or {}).get("phase") == "Running" for p in pods)
            and _status(cluster, ns, name).get("phase") == "Running" else None), timeout=60)
    except AssertionError as exc:  # say where the job and its pods stood
        seen = [(p["metadata"]["name"], (p.get("status") or {}).get("phase"),
                 bool(p["metadata"].get("deletionTimestamp"))) for p in pods_of(cluster, ns, name)]
        raise AssertionError(f"{exc}; status {_status(cluster, ns, name)}; pods {seen}") from None


def test_two_nodes_get_a_service_two_pods_and_each_pod_reports_its_own_worker_entry(
        memstrata_cluster: Any, ns: str, nodes: Any, tmp_path: Path) -> None:
    cluster = memstrata_cluster
    a, b = nodes.add("gang-a", dram_gib=64, gpus=1), nodes.add("gang-b", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("pair", resources={"gpus": 1, "nodes": 2}), ns)
    pods = _running_pair(cluster, ns, "pair", 0)
    uid = ftj(cluster, ns, "pair")["metadata"]["uid"]
    svc_name = names.service_name("pair", uid)
    svc = cluster.get_json("service", svc_name, "-n", ns)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["ports"][0]["port"] == RENDEZVOUS_PORT
    assert svc["metadata"]["ownerReferences"][0]["uid"] == uid
    assert svc["metadata"]["labels"][names.LABEL_JOB_UID] == uid
    # One pod on each node, bound by the real scheduler through the affinity; stable DNS names, rank 0 the master.
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted([a, b])
    for rank, p in enumerate(pods):
        assert p["metadata"]["name"] == f"pair-0-{rank}"
        assert (p["spec"]["hostname"], p["spec"]["subdomain"]) == (f"pair-{rank}", svc_name)
        env = _env(p)
        assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["PET_NODE_RANK"], env["PET_NNODES"]) == (
            f"pair-0.{svc_name}", str(RENDEZVOUS_PORT), str(rank), "2")
    status = _status(cluster, ns, "pair")
    assert status["nodes"] == [p["spec"]["nodeName"] for p in pods] and status["node"] == status["nodes"][0]

    # Each pod's runtime, with the job's token, merge-patches only its own workers entry: neither is lost.
    token = token_kubeconfig(cluster, ns, names.runtime_account_name("pair", uid), tmp_path / "runtime")

    def report(rank: int, step: int) -> None:
        worker = {"pod": pods[rank]["metadata"]["name"], "node": pods[rank]["spec"]["nodeName"], "ranks": 1,
                  "step": step, "attempt": 0}
        done = kubectl_as(cluster, token, "patch", "finetunejob", "pair", "-n", ns, "--subresource=status",
                          "--type=merge", "-p", json.dumps({"status": {"workers": {str(rank): worker}}}))
        assert done.returncode == 0, done.stderr

    report(0, 3)
    report(1, 4)
    report(0, 5)
    workers = wait("both workers reported", lambda: (w if len(w := _status(cluster, ns, "pair").get("workers") or {})
                                                      == 2 else None))
    assert (workers["0"]["step"], workers["1"]["step"]) == (5, 4)
    assert workers["1"]["node"] == pods[1]["spec"]["nodeName"]
    # The operator's own status writes (it keeps reconciling) leave them too.
    subprocess.run(["sleep", "1"], check=True)
    assert set(_status(cluster, ns, "pair")["workers"]) == {"0", "1"}

    # Deleting the job deletes its Service with it (the operator's cleanup, not only the garbage collector).
    cluster.kubectl("delete", "ftj", "pair", "-n", ns, "--wait=false")
    wait("the Service deleted with the job", lambda: not cluster.get_json("services", "-n", ns)["items"], timeout=60)


def test_a_lost_pod_fails_the_attempt_and_a_new_pair_replaces_both(memstrata_cluster: Any, ns: str,
                                                                    nodes: Any) -> None:
    cluster = memstrata_cluster
    nodes.add("gang-a", dram_gib=64, gpus=1)
    nodes.add("gang-b", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("lossy", resources={"gpus": 1, "nodes": 2}, run_policy={"backoffLimit": 1}), ns)
    first = _running_pair(cluster, ns, "lossy", 0)
    cluster.kubectl("delete", "pod", "lossy-0-1", "-n", ns, "--wait=false")  # as an eviction or a lost node
    # Its sibling is deleted by the operator; one failure is counted; a whole new pair runs.
    second = _running_pair(cluster, ns, "lossy", 1)
    assert [p["metadata"]["name"] for p in second] == ["lossy-1-0", "lossy-1-1"]
    # The same DNS names again: MASTER_ADDR never changes between attempts.
    assert [p["spec"]["hostname"] for p in second] == [p["spec"]["hostname"] for p in first]
    assert _env(second[0])["MASTER_ADDR"] == _env(first[0])["MASTER_ADDR"]
    wait("attempt 0's pods gone", lambda: not [p for p in pods_of(cluster, ns, "lossy")
                                               if p["metadata"]["labels"][names.LABEL_ATTEMPT] == "0"], timeout=60)
    status = _status(cluster, ns, "lossy")
    assert status["restarts"] == 1 and status["failedPods"] == ["lossy-0-1"], status
    assert "lossy-0-1" in status["lastFailure"]["message"]
    # The Service now selects the new attempt's pods only.
    svc = cluster.get_json("service", names.service_name("lossy", ftj(cluster, ns, "lossy")["metadata"]["uid"]),
                           "-n", ns)
    assert svc["spec"]["selector"][names.LABEL_ATTEMPT] == "1"


def test_over_the_backoff_limit_a_lost_pod_fails_the_job_naming_it(memstrata_cluster: Any, ns: str,
                                                                    nodes: Any) -> None:
    cluster = memstrata_cluster
    nodes.add("gang-a", dram_gib=64, gpus=1)
    nodes.add("gang-b", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("fragile", resources={"gpus": 1, "nodes": 2}, run_policy={"backoffLimit": 0}), ns)
    pods = _running_pair(cluster, ns, "fragile", 0)
    lost = pods[1]
    cluster.kubectl("delete", "pod", lost["metadata"]["name"], "-n", ns, "--wait=false")
    wait("fragile Failed", lambda: _status(cluster, ns, "fragile").get("phase") == "Failed", timeout=60)
    status = _status(cluster, ns, "fragile")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    assert "fragile-0-1" in failed["message"] and lost["spec"]["nodeName"] in failed["message"], failed
    wait("the sibling deleted too", lambda: not _live(cluster, ns, "fragile", 0), timeout=60)
    assert any(e["reason"] == "BackoffLimitExceeded" and "fragile-0-1" in e["message"]
               for e in events_of(cluster, ns, "fragile"))


def test_more_nodes_than_the_cluster_has_fails_as_impossible(memstrata_cluster: Any, ns: str, nodes: Any) -> None:
    cluster = memstrata_cluster
    nodes.add("gang-a", dram_gib=64, gpus=1)
    nodes.add("gang-b", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("huge", resources={"gpus": 1, "nodes": 3}), ns)
    wait("huge Failed", lambda: _status(cluster, ns, "huge").get("phase") == "Failed", timeout=60)
    failed = next(c for c in _status(cluster, ns, "huge")["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InsufficientNodes"
    assert "spec.resources.nodes is 3, but only 2 node(s) can ever hold this job" in failed["message"], failed
    assert not pods_of(cluster, ns, "huge")  # all or none: nothing was created


def test_a_quota_admitting_one_pod_of_two_keeps_the_attempt_and_completes_it_once_raised(
        memstrata_cluster: Any, ns: str, nodes: Any) -> None:
    """A ResourceQuota allowing fewer pods than the gang: the pod it admits is kept (not deleted and made again
    every second as a new attempt), the status and events say why the job waits, and once the quota is raised
    the missing pod of the same attempt is created on the node chosen for it."""
    cluster = memstrata_cluster
    nodes.add("gang-a", dram_gib=64, gpus=1)
    nodes.add("gang-b", dram_gib=64, gpus=1)
    quota = one_pod_quota(cluster, ns)
    apply_yaml(cluster, job("squeezed", resources={"gpus": 1, "nodes": 2}), ns)
    wait("squeezed says the quota stops it", lambda: "exceeded quota" in (
        _status(cluster, ns, "squeezed").get("message") or ""), timeout=60)
    (kept,) = wait("one pod admitted", lambda: pods if len(pods := _live(cluster, ns, "squeezed", 0)) == 1 else None)
    uid = kept["metadata"]["uid"]
    for _ in range(12):  # a few seconds: the admitted pod stays, no other attempt is made
        pods = pods_of(cluster, ns, "squeezed")
        assert [(p["metadata"]["uid"], bool(p["metadata"].get("deletionTimestamp"))) for p in pods] == [(uid, False)]
        subprocess.run(["sleep", "0.5"], check=True)
    status = _status(cluster, ns, "squeezed")
    assert status.get("attempts") == 1 and not status.get("activePod") and not status.get("failedPods"), status
    created = next(c for c in status["conditions"] if c["type"] == "Created")
    assert created["status"] == "False" and created["reason"] == "PodCreateFailed", created
    assert any(e["reason"] == "ReconcileError" and "exceeded quota" in e["message"]
               for e in events_of(cluster, ns, "squeezed"))
    apply_yaml(cluster, {**quota, "spec": {"hard": {"pods": "2"}}}, ns)
    pair = _running_pair(cluster, ns, "squeezed", 0)
    assert uid in [p["metadata"]["uid"] for p in pair]  # the same attempt, completed
    assert [p["spec"]["nodeName"] for p in pair] == _status(cluster, ns, "squeezed")["nodes"]
    assert _status(cluster, ns, "squeezed")["activePod"] == "squeezed-0-0"
