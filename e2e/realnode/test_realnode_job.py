"""`kubectl apply` of a FineTuneJob on the real node: the operator (in its container) plans and places
it, the kubelet runs the training container with the namespace the device plugin allocated, the
runtime trains SmolLM2-135M-Instruct through the raw engine on that device, status shows progress
and peaks per stratum, and the fine-tuned model lands on the output volume. The job's namespace
enforces PodSecurity `restricted`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from e2e.realnode.conftest import RealCluster
from e2e.realnode.jobs import JobStorage, events_of, smollm2_job, wait_phase
from e2e.realnode.node import KUBELET_ROOT

pytestmark = [pytest.mark.realnode, pytest.mark.cluster, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def allocated_devices(pod_uid: str) -> list[str]:
    """The device IDs the kubelet's device manager recorded for a pod (its checkpoint file)."""
    doc = json.loads((KUBELET_ROOT / "device-plugins" / "kubelet_internal_checkpoint").read_text())
    return [d for e in doc["Data"]["PodDeviceEntries"] if e["PodUID"] == pod_uid
            for ids in e["DeviceIDs"].values() for d in ids]


def explain(rc: RealCluster, ns: str, name: str) -> str:
    pods = rc.cp.get_json("pods", "-n", ns)["items"]
    logs = "\n".join(rc.node.container_logs(ns, p["metadata"]["name"]) for p in pods)
    return (f"events: {[(e['reason'], e['message']) for e in events_of(rc.cp, ns, name)]}\n"
            f"pods: {[(p['metadata']['name'], p['status'].get('phase')) for p in pods]}\n{logs[-8000:]}")


def test_a_finetunejob_trains_in_a_container_on_the_allocated_namespace(
        real_cluster: RealCluster, job_ns: str, tmp_path: Path, smollm2_dir: Path) -> None:
    rc, ns = real_cluster, job_ns
    store = JobStorage(rc.cp, ns, tmp_path / "volumes")
    store.create(smollm2_dir, (REPO / "examples" / "chat-skill.jsonl").read_text())
    try:
        rc.cp.apply(smollm2_job("chat", rc.images.runtime, steps=STEPS), namespace=ns)
        seen: list[int] = []
        pods: dict[str, dict[str, Any]] = {}

        def watch(body: dict[str, Any]) -> None:
            step = ((body.get("status") or {}).get("progress") or {}).get("step")
            if step is not None and (not seen or seen[-1] != step):
                seen.append(step)
            for p in rc.cp.get_json("pods", "-n", ns)["items"]:
                pods[p["metadata"]["name"]] = p

        body = wait_phase(rc.cp, ns, "chat", {"Succeeded", "Failed"}, timeout=1200, on_poll=watch)
        status = body["status"]
        assert status["phase"] == "Succeeded", explain(rc, ns, "chat")

        training = [p for p in pods.values() if p["metadata"]["labels"].get("memstrata.dev/role") != "inspect"
                    and p["spec"]["containers"][0]["image"] == rc.images.runtime]
        assert training, f"no training pod seen: {list(pods)}"
        pod = training[-1]
        assert pod["spec"]["nodeName"] == rc.node.name
        # The namespace the device plugin handed this pod is one of the node's loop devices.
        granted = allocated_devices(pod["metadata"]["uid"])
        assert len(granted) == 1 and granted[0] in rc.loops, (granted, rc.loops)

        progress = status["progress"]
        assert (progress["step"], progress["total"]) == (STEPS, STEPS)
        assert isinstance(progress["loss"], float) and 0 < progress["loss"] < 20
        assert any(0 < s < STEPS for s in seen), f"progress seen only at the end: {seen}"
        peaks = status["peakMemory"]
        assert peaks["dram"] > 200 << 20 and peaks["nvme"] > 100 << 20, peaks
        out = status["output"]
        assert out["path"] == "/output/chat" and out["step"] == STEPS and out["files"] >= 3
        model = store.output / "chat"
        assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()
        weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        assert weights > 200 << 20, f"fine-tuned weights on the volume: {weights} bytes"
        assert model.stat().st_uid == 1000  # written by the runtime's user, not root
        # The columns `kubectl get ftj` shows.
        row = rc.kubectl("get", "ftj", "chat", "-n", ns, "--no-headers")
        assert "Succeeded" in row and f"{STEPS}/{STEPS}" in row, row
    finally:
        store.delete()
