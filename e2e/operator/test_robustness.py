"""Restarts, replicas, many jobs at once, and the runtime's narrowly scoped identity."""
from __future__ import annotations

import json
import signal
import threading

import pytest

from e2e.operator.conftest import wait_active
from e2e.operator.harness import (
    apply_yaml, ftj, job, kubectl_as, mid_transition, pods_of, token_kubeconfig, wait,
)
from memstrata.api import RuntimeReport, StratumCounters

pytestmark = pytest.mark.cluster


def _phases(cluster, ns):
    items = cluster.get_json("ftj", "-n", ns)["items"]
    return {i["metadata"]["name"]: (i.get("status") or {}).get("phase") for i in items}


def _pods_per_job(cluster, ns):
    out: dict[str, list[str]] = {}
    for p in cluster.get_json("pods", "-n", ns)["items"]:
        owner = p["metadata"]["ownerReferences"][0]["name"]
        out.setdefault(owner, []).append(p["metadata"]["name"])
    return out


def _submit(cluster, ns, docs):
    cluster.kubectl("apply", "-n", ns, "-f", "-",
                    input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}), timeout=120)


def test_operator_killed_mid_flight_loses_no_job_and_duplicates_no_pod(memstrata_cluster, operator, ns, nodes):
    cluster = memstrata_cluster
    n = 40
    for i in range(n // 4):  # room for every job: one GPU each
        nodes.add(f"n{i}", dram_gib=64, gpus=4)
    submitter = threading.Thread(target=_submit, args=(cluster, ns, [job(f"j{i:02d}") for i in range(n)]))
    submitter.start()  # the kill comes while jobs are still arriving and being handled
    try:
        wait("the operator at work on a job", lambda: mid_transition(cluster, ns), timeout=30, interval=0.05)
        operator.stop(signal.SIGKILL)  # no cleanup, no goodbye: a crash
        busy = mid_transition(cluster, ns)
        created_while_up = len(_pods_per_job(cluster, ns))
    finally:
        submitter.join()
        if not operator.alive():
            operator.start()  # a new identity: it waits out the dead process's Lease, as a restarted pod would
    # Landed mid-flight: jobs the operator had begun (its finalizer on them) were not yet recorded Running.
    assert busy, "the kill came after every job was placed and recorded: this run proved nothing"
    wait_active(cluster, operator)
    wait(f"all {n} jobs Running", lambda: list(_phases(cluster, ns).values()).count("Running") == n, timeout=120)
    per_job = _pods_per_job(cluster, ns)
    assert sorted(per_job) == [f"j{i:02d}" for i in range(n)]
    assert all(pods == [f"{name}-0"] for name, pods in per_job.items()), per_job
    assert all(ftj(cluster, ns, name)["status"]["attempts"] == 1 for name in per_job)
    print(f"kill landed with {busy} jobs mid-transition and {created_while_up}/{n} pods created")


def test_runtime_identity_may_patch_its_own_status_and_nothing_else(memstrata_cluster, ns, nodes, tmp_path):
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=2)
    apply_yaml(cluster, job("mine"), ns)
    apply_yaml(cluster, job("theirs"), ns)
    wait("both Running", lambda: set(_phases(cluster, ns).values()) == {"Running"})
    sa = pods_of(cluster, ns, "mine")[0]["spec"]["serviceAccountName"]
    kc = token_kubeconfig(cluster, ns, sa, tmp_path / "runtime.kubeconfig")

    report = RuntimeReport(stage="training", step=30, total_steps=60, loss=1.25, tokens_per_second=812.0,
                           elapsed_seconds=90.0, strata={"dram": StratumCounters(peak_bytes=3 << 30)})
    patch = json.dumps(report.status_patch())
    ok = kubectl_as(cluster, kc, "patch", "ftj", "mine", "--subresource=status", "--type=merge", "-p", patch)
    assert ok.returncode == 0, ok.stderr
    row = cluster.kubectl("get", "ftj", "mine", "-n", ns, "--no-headers").split()
    assert row[3:6] == ["30/60", "(50%)", "1m30s"]  # Progress and ETA columns
    status = ftj(cluster, ns, "mine")["status"]
    assert status["progress"]["loss"] == 1.25 and status["peakMemory"] == {"dram": 3 << 30}
    assert status["phase"] == "Running"  # the operator's fields survive the runtime's patch

    for args in (("patch", "ftj", "theirs", "--subresource=status", "--type=merge", "-p", patch),
                 ("patch", "ftj", "mine", "--type=merge", "-p", '{"spec":{"runPolicy":{"backoffLimit":9}}}'),
                 ("get", "pods"), ("get", "ftj", "theirs"), ("delete", "ftj", "mine")):
        denied = kubectl_as(cluster, kc, *args)
        assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), (args, denied.stderr)
    assert "progress" not in (ftj(cluster, ns, "theirs")["status"])
