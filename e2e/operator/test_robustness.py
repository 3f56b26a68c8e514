"""Restarts, replicas, many jobs at once, and the runtime's narrowly scoped identity."""
from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import pytest

from e2e.operator.conftest import wait_active
from e2e.operator.harness import (
    SUCCEED_LABEL, apply_yaml, events_of, ftj, job, kubectl_as, mid_transition, one_pod_quota, pods_of,
    token_kubeconfig, wait,
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


def _kill_mid_transition(operator, busy_jobs, timeout: float = 60) -> int:
    """SIGKILL the operator at a moment some job is mid-transition, and how many were: each time one is seen, the
    operator is frozen (SIGSTOP) and looked at again, and killed only if it still has one; else it is thawed and
    watched again. Without the freeze it can finish every job it had begun between the look and the kill (a
    loaded CI machine did, and the run proved nothing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if busy_jobs():
            operator.signal(signal.SIGSTOP)
            busy = busy_jobs()  # only the operator begins or records a job; what it had sent lands before this look's reply
            if busy:
                operator.stop(signal.SIGKILL)  # no cleanup, no goodbye: a crash
                return busy
            operator.signal(signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError(f"no job was seen mid-transition in {timeout:.0f} s")


def test_operator_killed_mid_flight_loses_no_job_and_duplicates_no_pod(memstrata_cluster, operator, ns, nodes):
    cluster = memstrata_cluster
    n = 40
    for i in range(n // 4):  # room for every job: one GPU each
        nodes.add(f"n{i}", dram_gib=64, gpus=4)
    docs = [job(f"j{i:02d}") for i in range(n)]
    # In batches, so that there is work in flight for a while: the kill comes while jobs are still arriving.
    submitter = threading.Thread(target=lambda: [_submit(cluster, ns, docs[i:i + 5]) for i in range(0, n, 5)])
    submitter.start()
    try:
        busy = _kill_mid_transition(operator, lambda: mid_transition(cluster, ns))
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


def _refused(item):
    created = next((c for c in (item.get("status") or {}).get("conditions") or [] if c["type"] == "Created"), {})
    return created.get("status") == "False" and "exceeded quota" in created.get("message", "")


def test_jobs_a_pod_quota_refuses_are_pending_saying_why_at_once(memstrata_cluster, ns, nodes):
    """A ResourceQuota of one pod and five jobs, with room on the nodes for all: one job runs, and each of the
    other four says at once that it is Pending and why (the quota's refusal in its Created condition), not a
    blank status for minutes with one event."""
    cluster = memstrata_cluster
    nodes.add("quota", dram_gib=64, gpus=4)
    nodes.add("quota2", dram_gib=64, gpus=4)
    one_pod_quota(cluster, ns)
    start = time.monotonic()
    _submit(cluster, ns, [job(f"q{i}") for i in range(5)])

    def settled():
        items = cluster.get_json("ftj", "-n", ns)["items"]
        waiting = [i for i in items if (i.get("status") or {}).get("phase") == "Pending" and _refused(i)]
        running = [i for i in items if (i.get("status") or {}).get("phase") == "Running"]
        return (running, waiting) if len(running) == 1 and len(waiting) == 4 else None

    running, waiting = wait("one job Running, four Pending with the quota's refusal", settled, timeout=30)
    took = time.monotonic() - start
    assert sorted(_pods_per_job(cluster, ns)) == [running[0]["metadata"]["name"]]
    for item in waiting:
        status = item["status"]
        # Nothing was created: no attempt is spent, none is recorded as current.
        assert "attempts" not in status and "activePod" not in status, status
        assert "exceeded quota" in status["message"], status
    print(f"4 of 5 jobs Pending with the quota's refusal {took:.1f}s after they were submitted")


def _patch_status(cluster, ns, name, status):
    return subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "patch", "ftj",
                           name, "-n", ns, "--subresource=status", "--type=merge", "-p",
                           json.dumps({"status": status})], capture_output=True, text=True, timeout=60)


def test_malformed_bookkeeping_in_status_neither_fails_the_job_nor_stops_its_reconciles(memstrata_cluster, ns, nodes):
    """The operator's own status fields hold garbage (a hand edit): the running pod stays, the job is not failed
    (backoffLimit 0: one false failure would fail it), each field is repaired with a warning event naming it, and
    the job still goes on to succeed. Wrong types never get that far: the CRD's schema refuses them."""
    cluster = memstrata_cluster
    nodes.add("gpu", dram_gib=64, gpus=1)
    apply_yaml(cluster, job("kept", run_policy={"backoffLimit": 0}), ns)
    wait("kept Running", lambda: (ftj(cluster, ns, "kept").get("status") or {}).get("phase") == "Running")
    (pod,) = pods_of(cluster, ns, "kept")
    uid = pod["metadata"]["uid"]
    for field, value, repaired in (("activePod", "zzz", "kept-0"), ("failedPods", ["abc"], None),
                                   ("activePod", "kept-7", "kept-0")):
        done = _patch_status(cluster, ns, "kept", {field: value})
        assert done.returncode == 0, done.stderr
        wait(f"status.{field}: {value!r} repaired", lambda: ftj(cluster, ns, "kept")["status"].get(field) == repaired)
        status = ftj(cluster, ns, "kept")["status"]
        assert status["phase"] == "Running" and "failedPods" not in status and "lastFailure" not in status, status
        assert [(p["metadata"]["uid"], p["metadata"].get("deletionTimestamp")) for p in pods_of(cluster, ns, "kept")] \
            == [(uid, None)]
    told = [e["message"] for e in events_of(cluster, ns, "kept") if e["reason"] == "MalformedStatus"]
    assert all(e["type"] == "Warning" for e in events_of(cluster, ns, "kept") if e["reason"] == "MalformedStatus")
    assert any("status.activePod" in m and "zzz" in m for m in told), told
    assert any("status.failedPods" in m and "abc" in m for m in told), told
    for field, value in (("failedPods", "abc"), ("attempts", "x"), ("activePod", 5), ("lastFailure", "boom"),
                         ("shortfalls", 5), ("announcedCheckpoint", "x")):
        refused = _patch_status(cluster, ns, "kept", {field: value})
        assert refused.returncode != 0 and f"status.{field}" in refused.stderr, (field, refused.stderr)
    cluster.kubectl("label", "pod", "kept-0", "-n", ns, f"{SUCCEED_LABEL}=true")
    wait("kept Succeeded", lambda: ftj(cluster, ns, "kept")["status"].get("phase") == "Succeeded")
