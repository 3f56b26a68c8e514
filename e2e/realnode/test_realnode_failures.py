"""A run that fails inside its container on the real node says why where the user looks: the job's
`Failed` condition message and a Warning event on the job — not only the pod's termination message.

- a bad dataset (a line that is not JSON): the runtime's own error, naming the file and line;
- an OOM kill (the container outgrows the memory limit the plan set): the kernel's verdict, OOMKilled;
- a device error (the namespace turns read-only mid-run): the engine's error, naming the device.
"""
from __future__ import annotations

import subprocess

import pytest

from e2e.realnode.conftest import REPO, RealCluster
from e2e.realnode.jobs import (
    JobStorage, allocated_devices, events_of, explain, smollm2_job, training_pod, wait_phase, wait_step_past,
)

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]


def failed_condition(body: dict) -> dict:
    conds = {c["type"]: c for c in body["status"].get("conditions") or []}
    assert conds.get("Failed", {}).get("status") == "True", body["status"]
    return conds["Failed"]


def warning_messages(rc: RealCluster, ns: str, name: str) -> list[str]:
    return [e["message"] for e in events_of(rc.cp, ns, name) if e.get("type") == "Warning"]


def test_a_bad_dataset_fails_the_job_with_the_runtimes_reason(
        real_cluster: RealCluster, job_ns: str, storage: JobStorage) -> None:
    rc, ns = real_cluster, job_ns
    good = (REPO / "examples" / "chat-skill.jsonl").read_text().splitlines()
    # What a user produces by hand-editing a JSONL file: a trailing comma on line 3.
    broken = "\n".join([*good[:2], good[2] + ",", *good[3:]]) + "\n"
    storage.set_dataset(broken)
    rc.cp.apply(smollm2_job("bad-data", rc.images.runtime), namespace=ns)
    body = wait_phase(rc.cp, ns, "bad-data", {"Succeeded", "Failed"}, timeout=600)
    message = failed_condition(body)["message"]
    assert "/data/chat.jsonl:3" in message, f"{message}\n{explain(rc.cp, rc.node, ns, 'bad-data')}"
    assert any("/data/chat.jsonl:3" in m for m in warning_messages(rc, ns, "bad-data")), \
        warning_messages(rc, ns, "bad-data")


def test_an_oom_killed_container_fails_the_job_with_oomkilled(
        real_cluster: RealCluster, job_ns: str, storage: JobStorage) -> None:
    rc, ns = real_cluster, job_ns
    # The pod's limit is the plan's DRAM plus the runtime's own; this command takes far more, as a
    # leaking data loader would. (The memory limit, not the test, is what stops it.)
    grow = "b = []\nwhile True: b.append(bytearray(64 << 20))"
    job = smollm2_job("oom", rc.images.runtime, extra_spec={"command": ["python", "-c", grow]})
    rc.cp.apply(job, namespace=ns)
    body = wait_phase(rc.cp, ns, "oom", {"Succeeded", "Failed"}, timeout=600)
    message = failed_condition(body)["message"]
    assert "OOMKilled" in message, f"{message}\n{explain(rc.cp, rc.node, ns, 'oom')}"
    assert any("OOMKilled" in m for m in warning_messages(rc, ns, "oom")), warning_messages(rc, ns, "oom")


def test_a_namespace_gone_read_only_mid_run_fails_the_job_naming_the_device(
        real_cluster: RealCluster, job_ns: str, storage: JobStorage) -> None:
    """A drive that turns read-only (an NVMe namespace out of spare blocks does) under a running job: the
    engine's write error, with the device named, is the job's Failed reason; once writable again the node
    agent scrubs what the job left and offers the namespace again."""
    rc, ns = real_cluster, job_ns
    device = ""
    try:
        rc.cp.apply(smollm2_job("ro", rc.images.runtime, steps=30), namespace=ns)
        wait_step_past(rc.cp, ns, "ro", 30, 0, timeout=600)
        [device] = allocated_devices(training_pod(rc.cp, ns, rc.images.runtime)["metadata"]["uid"])
        subprocess.run(["blockdev", "--setro", f"/dev/{device}"], check=True)
        body = wait_phase(rc.cp, ns, "ro", {"Succeeded", "Failed"}, timeout=600)
        message = failed_condition(body)["message"]
        assert f"/dev/{device}" in message and "EPERM" in message, f"{message}\n{explain(rc.cp, rc.node, ns, 'ro')}"
        assert any(f"/dev/{device}" in m for m in warning_messages(rc, ns, "ro")), warning_messages(rc, ns, "ro")
    finally:
        if device:
            # Not check=True: a failure here must not hide the test's own.
            subprocess.run(["blockdev", "--setrw", f"/dev/{device}"])
    # The namespace comes back: scrubbed (the job died with its data on it), then Healthy.
    rc.cp.wait_for("the namespace offered again", lambda: rc.node_json()["status"].get("allocatable", {})
                   .get("memstrata.dev/nvme-ns") == str(len(rc.loops)), timeout=300, interval=1)
