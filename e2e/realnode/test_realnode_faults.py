"""Faults on the real node while a FineTuneJob trains: the kubelet restarted (the device plugin registers
again — the seconds it takes are printed — and the running pod keeps its container and its device),
the node-agent pod deleted (its DaemonSet replaces it and no namespace is handed out twice), and
containerd restarted (the container keeps running under its shim). The job then Succeeds."""
from __future__ import annotations

import time
from typing import Any

import pytest

from e2e.conftest import _say
from e2e.realnode.conftest import RELEASE_NS, RealCluster
from e2e.realnode.jobs import (
    JobStorage, allocated_devices, explain, smollm2_job, training_pod, wait_phase, wait_step_past,
)

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]
# Enough to outlast the three faults (here they landed by step 5 of a job at ~3 s a step); each fault checks it
# landed mid-flight and prints the step it landed at, so a shrinking margin shows in the log.
STEPS = 24
REGISTERED = "memstrata.dev/nvme-ns"
# The kubelet's own lines (pkg/kubelet/cm/devicemanager): a plugin connected, and the devices it listed.
CONNECTED = f'"Device plugin connected" resourceName="{REGISTERED}"'
PROCESSED = f'"Processed device updates for resource" resourceName="{REGISTERED}"'


def plugin_serving(log: str, healthy: int) -> bool:
    """Whether the last device plugin to connect in this stretch of the kubelet's log has listed `healthy` healthy
    devices: until then the kubelet refuses a pod that asks for one ("no healthy devices present"), though the
    scheduler, which sees the node's last allocatable, sends it there."""
    connected = log.rfind(CONNECTED)
    return connected >= 0 and f"{PROCESSED} totalCount={healthy} healthyCount={healthy}" in log[connected:]


def container_identity(pod: dict[str, Any]) -> tuple[str, int]:
    cs = pod["status"]["containerStatuses"][0]
    assert "running" in cs["state"], cs["state"]
    return cs["containerID"], cs["restartCount"]


def pause_pod(name: str, image: str, namespaces: int = 1) -> dict[str, Any]:
    """A pod asking for `namespaces` namespaces, meeting `restricted`."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "c", "image": image, "imagePullPolicy": "Never",
                        "resources": {"limits": {REGISTERED: str(namespaces)}} if namespaces else {},
                        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}}


def test_kubelet_agent_and_containerd_restarts_leave_a_training_job_running(
        real_cluster: RealCluster, job_ns: str, storage: JobStorage,
        request: pytest.FixtureRequest) -> None:
    rc, ns = real_cluster, job_ns
    rc.cp.apply(smollm2_job("faults", rc.images.runtime, steps=STEPS), namespace=ns)
    step = wait_step_past(rc.cp, ns, "faults", STEPS, 0, timeout=600)
    pod = training_pod(rc.cp, ns, rc.images.runtime)
    identity, uid = container_identity(pod), pod["metadata"]["uid"]
    devices = allocated_devices(uid)
    assert len(devices) == 1, devices

    # 1. The kubelet restarts: the plugin must register with the new kubelet.sock.
    log = rc.node.workdir / "kubelet.log"
    offset = log.stat().st_size
    agent = rc.agent_pod()
    assert agent is not None
    registered = rc.metrics("pods", agent["metadata"]["name"]).value(
        "memstrata_nodeagent_kubelet_registrations_total", resource=REGISTERED, result="ok")
    rc.node.restart_kubelet()
    back = time.monotonic()
    rc.cp.wait_for("the device plugin to register with the restarted kubelet and list its devices",
                   lambda: plugin_serving(log.read_text(errors="replace")[offset:], len(rc.loops)), timeout=60)
    seconds = time.monotonic() - back
    _say(request, f"[realnode] kubelet restart at step {step}/{STEPS}: the device plugin registered again "
                  f"{seconds:.1f} s after the kubelet came back")
    # The agent's metrics count the registration the restart caused (at least one: a try may have met the
    # kubelet still starting).
    again = rc.metrics("pods", agent["metadata"]["name"]).value(
        "memstrata_nodeagent_kubelet_registrations_total", resource=REGISTERED, result="ok")
    assert again >= registered + 1, (registered, again)
    rc.node.wait_ready(60)
    assert container_identity(training_pod(rc.cp, ns, rc.images.runtime)) == identity
    assert allocated_devices(uid) == devices
    step = wait_step_past(rc.cp, ns, "faults", STEPS, step)

    # 2. The node-agent pod is deleted: the DaemonSet replaces it; the held namespace stays held.
    old = rc.agent_pod()
    assert old is not None
    offset = log.stat().st_size
    rc.kubectl("delete", "pod", old["metadata"]["name"], "-n", RELEASE_NS, "--wait=true", timeout=120)
    rc.cp.wait_for("a new node-agent pod Running", lambda: bool(
        (new := rc.agent_pod()) and new["metadata"]["uid"] != old["metadata"]["uid"]
        and new["status"].get("phase") == "Running"), timeout=120)
    # Running is not serving: its plugin registers and lists the devices moments later (seconds on a busy machine).
    rc.cp.wait_for("the new agent's device plugin to list the namespaces",
                   lambda: plugin_serving(log.read_text(errors="replace")[offset:], len(rc.loops)), timeout=60)
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
    assert container_identity(training_pod(rc.cp, ns, rc.images.runtime)) == identity
    step = wait_step_past(rc.cp, ns, "faults", STEPS, step)

    # 3. containerd restarts: the container runs on under its shim; the kubelet reconnects (it starts a
    #    new pod through the new containerd).
    rc.node.restart_containerd()
    rc.cp.apply(pause_pod("after-containerd", rc.images.pause, namespaces=0), namespace=ns)
    rc.cp.wait_for("a new pod Running through the restarted containerd", lambda: rc.cp.get_json(
        "pod", "after-containerd", "-n", ns)["status"].get("phase") == "Running", timeout=120)
    step = wait_step_past(rc.cp, ns, "faults", STEPS, step)
    assert container_identity(training_pod(rc.cp, ns, rc.images.runtime)) == identity
    _say(request, f"[realnode] containerd restarted; training went on to step {step}/{STEPS} in the same container")

    body = wait_phase(rc.cp, ns, "faults", {"Succeeded", "Failed"}, timeout=1200)
    assert body["status"]["phase"] == "Succeeded", explain(rc.cp, rc.node, ns, "faults")
    assert body["status"].get("restarts", 0) == 0
