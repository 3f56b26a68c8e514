"""`kubectl apply` of a FineTuneJob on the real node: the operator (in its container) plans and places
it, the kubelet runs the training container with the namespace the device plugin allocated, the
runtime trains SmolLM2-135M-Instruct through the raw engine on that device, status shows progress
and peaks per stratum, and the fine-tuned model lands on the output volume. The job's namespace
enforces PodSecurity `restricted`."""
from __future__ import annotations

from typing import Any

import pytest

from e2e.realnode.conftest import RealCluster
from e2e.realnode.jobs import JobStorage, allocated_devices, container_env, explain, smollm2_job, wait_phase

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]
STEPS = 6


def test_a_finetunejob_trains_in_a_container_on_the_allocated_namespace(
        real_cluster: RealCluster, job_ns: str, storage: JobStorage) -> None:
    rc, ns = real_cluster, job_ns
    rc.cp.apply(smollm2_job("chat", rc.images.runtime, steps=STEPS), namespace=ns)
    seen: list[int] = []
    pods: dict[str, dict[str, Any]] = {}
    env: dict[str, dict[str, str]] = {}  # the training container's environment, read while it ran

    def watch(body: dict[str, Any]) -> None:
        step = ((body.get("status") or {}).get("progress") or {}).get("step")
        if step is not None and (not seen or seen[-1] != step):
            seen.append(step)
        for p in rc.cp.get_json("pods", "-n", ns)["items"]:
            pods[p["metadata"]["name"]] = p
            if p["metadata"].get("labels", {}).get("memstrata.dev/role") is None and p["metadata"]["name"] not in env:
                found = container_env(rc.node, p)
                if found is not None:
                    env[p["metadata"]["name"]] = found

    body = wait_phase(rc.cp, ns, "chat", {"Succeeded", "Failed"}, timeout=1200, on_poll=watch)
    status = body["status"]
    assert status["phase"] == "Succeeded", explain(rc.cp, rc.node, ns, "chat")

    # Seen while it ran: the model inspection pod (same image) came and went before it.
    training = [p for p in pods.values() if p["metadata"].get("labels", {}).get("memstrata.dev/role") is None
                and p["spec"]["containers"][0]["image"] == rc.images.runtime]
    assert len(training) == 1, f"training pods seen: {[p['metadata']['name'] for p in training]}"
    pod = training[0]
    assert pod["spec"]["nodeName"] == rc.node.name
    # The namespace the device plugin handed this pod is one of the node's loop devices.
    granted = allocated_devices(pod["metadata"]["uid"])
    assert len(granted) == 1 and granted[0] in rc.loops, (granted, rc.loops)
    # ... and the device plugin's Allocate handed the container exactly that device node.
    seen_env = env.get(pod["metadata"]["name"])
    assert seen_env is not None, "the training container's environment was never read while it ran"
    assert seen_env.get("MEMSTRATA_NVME_DEVICES") == f"/dev/{granted[0]}", seen_env.get("MEMSTRATA_NVME_DEVICES")
    assert "MEMSTRATA_CXL_NODES" not in seen_env  # no CXL memory on this node, none requested

    progress = status["progress"]
    assert (progress["step"], progress["total"]) == (STEPS, STEPS)
    assert isinstance(progress["loss"], float) and 0 < progress["loss"] < 20
    assert any(0 < s < STEPS for s in seen), f"progress seen only at the end: {seen}"
    peaks = status["peakMemory"]
    assert peaks["dram"] > 200 << 20 and peaks["nvme"] > 100 << 20, peaks
    out = status["output"]
    assert out["path"] == "/output/chat" and out["step"] == STEPS and out["files"] >= 3
    model = storage.output / "chat"
    assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    assert weights > 200 << 20, f"fine-tuned weights on the volume: {weights} bytes"
    assert model.stat().st_uid == 1000  # written by the runtime's user, not root
    # The columns `kubectl get ftj` shows.
    row = rc.kubectl("get", "ftj", "chat", "-n", ns, "--no-headers")
    assert "Succeeded" in row and f"{STEPS}/{STEPS}" in row, row
