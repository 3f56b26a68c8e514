"""Faults on the real node while a FineTuneJob trains: the kubelet restarted (the device plugin registers
again — the seconds it takes are printed — and the running pod keeps its container and its device),
the node-agent pod deleted (its DaemonSet replaces it and no namespace is handed out twice), and
containerd restarted (the container keeps running under its shim). The job then Succeeds."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from e2e.conftest import _say
from e2e.realnode.conftest import RELEASE_NS, RealCluster
from e2e.realnode.jobs import JobStorage, smollm2_job, wait_phase
from e2e.realnode.test_realnode_job import REPO, allocated_devices, explain

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]
STEPS = 30
REGISTERED = "memstrata.dev/nvme-ns"


def training_pod(rc: RealCluster, ns: str) -> dict[str, Any]:
    pods = [p for p in rc.cp.get_json("pods", "-n", ns)["items"]
            if p["spec"]["containers"][0]["image"] == rc.images.runtime
            and p["metadata"].get("labels", {}).get("memstrata.dev/role") is None]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]


def container_identity(pod: dict[str, Any]) -> tuple[str, int]:
    cs = pod["status"]["containerStatuses"][0]
    assert "running" in cs["state"], cs["state"]
    return cs["containerID"], cs["restartCount"]


def step_of(rc: RealCluster, ns: str) -> int:
    status = rc.cp.get_json("finetunejob", "faults", "-n", ns).get("status") or {}
    return int((status.get("progress") or {}).get("step") or 0)


def wait_step_past(rc: RealCluster, ns: str, step: int, timeout: float = 300) -> int:
    """Training goes on: the reported step moves past `step` (and the job has not finished)."""
    now = {"step": step}

    def moved() -> bool:
        now["step"] = step_of(rc, ns)
        return now["step"] > step

    rc.cp.wait_for(f"training to go past step {step}", moved, timeout=timeout, interval=1)
    assert now["step"] < STEPS, "the job finished before the fault could land mid-flight; raise STEPS"
    return now["step"]


def pause_pod(name: str, image: str) -> dict[str, Any]:
    """A pod asking for one namespace, meeting `restricted`."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "c", "image": image, "imagePullPolicy": "Never",
                        "resources": {"limits": {REGISTERED: "1"}},
                        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}}


def test_kubelet_agent_and_containerd_restarts_leave_a_training_job_running(
        real_cluster: RealCluster, job_ns: str, tmp_path: Path, smollm2_dir: Path,
        request: pytest.FixtureRequest) -> None:
    rc, ns = real_cluster, job_ns
    store = JobStorage(rc.cp, ns, tmp_path / "volumes")
    store.create(smollm2_dir, (REPO / "examples" / "chat-skill.jsonl").read_text())
    try:
        rc.cp.apply(smollm2_job("faults", rc.images.runtime, steps=STEPS), namespace=ns)
        step = wait_step_past(rc, ns, 0, timeout=600)
        pod = training_pod(rc, ns)
        identity, uid = container_identity(pod), pod["metadata"]["uid"]
        devices = allocated_devices(uid)
        assert len(devices) == 1, devices

        # 1. The kubelet restarts: the plugin must register with the new kubelet.sock.
        log = rc.node.workdir / "kubelet.log"
        offset = log.stat().st_size
        rc.node.restart_kubelet()
        back = time.monotonic()
        rc.cp.wait_for("the device plugin to register with the restarted kubelet",
                       lambda: REGISTERED in log.read_text(errors="replace")[offset:], timeout=60)
        seconds = time.monotonic() - back
        _say(request, f"[realnode] kubelet restart: the device plugin registered again {seconds:.1f} s after "
                      "the kubelet came back")
        rc.node.wait_ready(60)
        assert container_identity(training_pod(rc, ns)) == identity
        assert allocated_devices(uid) == devices
        step = wait_step_past(rc, ns, step)

        # 2. The node-agent pod is deleted: the DaemonSet replaces it; the held namespace stays held.
        old = rc.agent_pod()
        assert old is not None
        rc.kubectl("delete", "pod", old["metadata"]["name"], "-n", RELEASE_NS, "--wait=true", timeout=120)
        rc.cp.wait_for("a new node-agent pod Running", lambda: bool(
            (new := rc.agent_pod()) and new["metadata"]["uid"] != old["metadata"]["uid"]
            and new["status"].get("phase") == "Running"), timeout=120)
        free = len(rc.loops) - 1
        claimants = [pause_pod(f"claim-{i}", rc.images.pause) for i in range(free + 1)]
        rc.cp.apply(*claimants, namespace=ns)

        def settled() -> bool:
            pods = [rc.cp.get_json("pod", c["metadata"]["name"], "-n", ns) for c in claimants]
            running = [p for p in pods if p["status"].get("phase") == "Running"]
            pending = [p for p in pods if any(c.get("reason") == "Unschedulable"
                                              for c in p["status"].get("conditions") or [])]
            return len(running) == free and len(pending) == 1

        rc.cp.wait_for("the free namespaces to be claimed and one claimant refused", settled, timeout=120)
        granted = [d for c in claimants for d in allocated_devices(rc.cp.get_json(
            "pod", c["metadata"]["name"], "-n", ns)["metadata"]["uid"])]
        assert len(granted) == free and not set(granted) & set(devices), (granted, devices)
        rc.kubectl("delete", "pod", *(c["metadata"]["name"] for c in claimants), "-n", ns, "--wait=false")
        assert container_identity(training_pod(rc, ns)) == identity
        step = wait_step_past(rc, ns, step)

        # 3. containerd restarts: the container runs on under its shim; the kubelet reconnects.
        rc.node.restart_containerd()
        step = wait_step_past(rc, ns, step)
        assert container_identity(training_pod(rc, ns)) == identity

        body = wait_phase(rc.cp, ns, "faults", {"Succeeded", "Failed"}, timeout=1200)
        assert body["status"]["phase"] == "Succeeded", explain(rc, ns, "faults")
        assert body["status"].get("restarts", 0) == 0
    finally:
        store.delete()
