"""What the real-node tests submit: storage as a cluster admin provides it (hostPath PersistentVolumes
bound to the job's claims, the dataset in a ConfigMap) and FineTuneJobs of the real small model.

    store = JobStorage(real_cluster, ns, tmp_path); store.create(model_dir, dataset_text)
    real_cluster.cp.apply(smollm2_job("chat", ns, image, steps=6), namespace=ns)
    body = wait_phase(real_cluster.cp, ns, "chat", {"Succeeded", "Failed"}, timeout=900)
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from e2e.cluster.controlplane import ControlPlane, ControlPlaneTimeout
from e2e.realnode.hoststate import KUBELET_ROOT
from e2e.realnode.node import RealNode
from memstrata.api.podidentity import RUNTIME_UID

MODEL_DIR = "smollm2"


class JobStorage:
    """A models volume (a copy of the model, readable by the runtime's uid) and an output volume, as
    hostPath PersistentVolumes bound to claims `models` and `output` in `namespace`."""

    def __init__(self, cp: ControlPlane, namespace: str, root: Path) -> None:
        self.cp, self.ns, self.root = cp, namespace, root
        self.models, self.output = root / "models", root / "output"
        self.pvs: list[str] = []

    def create(self, model_dir: Path, dataset: str) -> None:
        shutil.copytree(model_dir, self.models / MODEL_DIR)
        self.output.mkdir(parents=True)
        for path in (self.root, self.models, self.output):
            path.chmod(0o755)
        for f in (self.models / MODEL_DIR).iterdir():
            f.chmod(0o644)  # what a user copying a model onto a volume gets; the cache keeps its own modes
        # hostPath volumes have no fsGroup: the directory itself is the runtime user's, as on any NFS export.
        shutil.chown(self.output, RUNTIME_UID, RUNTIME_UID)
        for claim, path, mode in (("models", self.models, "ReadOnlyMany"), ("output", self.output, "ReadWriteOnce")):
            pv = f"{self.ns}-{claim}"
            self.cp.create({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                            "spec": {"capacity": {"storage": "10Gi"}, "accessModes": [mode], "storageClassName": "",
                                     "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(path)},
                                     "claimRef": {"namespace": self.ns, "name": claim}}})
            self.pvs.append(pv)
            self.cp.create({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
                            "spec": {"accessModes": [mode], "storageClassName": "", "volumeName": pv,
                                     "resources": {"requests": {"storage": "10Gi"}}}}, namespace=self.ns)
        self.set_dataset(dataset)

    def set_dataset(self, text: str, name: str = "dataset") -> None:
        self.cp.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
                       "data": {"chat.jsonl": text}}, namespace=self.ns)

    def delete(self) -> None:
        if self.pvs:
            self.cp.kubectl("delete", "pv", "--wait=false", "--ignore-not-found", *self.pvs)


def smollm2_job(name: str, image: str, *, steps: int = 6, dram_budget: str = "1200Mi",
                dataset_configmap: str = "dataset", extra_spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """A full fine-tune of SmolLM2-135M-Instruct on the chat dataset, on the CPU, with part of its state
    on the node's NVMe namespace (a loop device here), writing the model to the output volume."""
    return {
        "apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": name},
        "spec": {
            "model": {"path": f"/models/{MODEL_DIR}"},
            "dataset": {"path": "/data/chat.jsonl", "format": "messages"},
            "training": {"sequenceLength": 128, "microBatch": 2, "steps": steps, "learningRate": 3.0e-4,
                         "precision": "bf16", "activationCheckpointing": False},
            "resources": {"gpus": 0},
            "memory": {"engine": "memstrata", "dramBudget": dram_budget},
            "output": {"path": f"/output/{name}"},
            "image": image,
            "volumes": [
                {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
                {"name": "data", "configMap": {"name": dataset_configmap}},
                {"name": "output", "persistentVolumeClaim": {"claimName": "output"}},
            ],
            "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True},
                             {"name": "data", "mountPath": "/data", "readOnly": True},
                             {"name": "output", "mountPath": "/output"}],
            "runPolicy": {"backoffLimit": 0},
            **(extra_spec or {}),
        },
    }


def wait_phase(cp: ControlPlane, ns: str, name: str, phases: set[str], timeout: float,
               on_poll: Any = None) -> dict[str, Any]:
    """Poll the job until its phase is one of `phases`; `on_poll(body)` sees every poll (progress)."""
    deadline = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = cp.get_json("finetunejob", name, "-n", ns)
        if on_poll is not None:
            on_poll(body)
        if (body.get("status") or {}).get("phase") in phases:
            return body
        time.sleep(1)
    raise ControlPlaneTimeout(f"job {ns}/{name} not in {sorted(phases)} after {timeout:.0f} s; status "
                              f"{json.dumps(body.get('status'), indent=1)[-3000:]}")


def events_of(cp: ControlPlane, ns: str, name: str) -> list[dict[str, Any]]:
    items = cp.get_json("events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
    return sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")


def training_pod(cp: ControlPlane, ns: str, image: str) -> dict[str, Any]:
    """The one training pod of the namespace's job (not the model inspection pod)."""
    pods = [p for p in cp.get_json("pods", "-n", ns)["items"]
            if p["spec"]["containers"][0]["image"] == image
            and p["metadata"].get("labels", {}).get("memstrata.dev/role") is None]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]


def wait_step_past(cp: ControlPlane, ns: str, name: str, steps: int, step: int, timeout: float = 300) -> int:
    """Training goes on: job `name`'s reported step moves past `step`, still short of its `steps` (so
    whatever the caller does next lands mid-flight); returns the step seen."""
    now = {"step": step}

    def moved() -> bool:
        status = cp.get_json("finetunejob", name, "-n", ns).get("status") or {}
        now["step"] = int((status.get("progress") or {}).get("step") or 0)
        return now["step"] > step

    cp.wait_for(f"job {name} to go past step {step}", moved, timeout=timeout, interval=1)
    assert now["step"] < steps, f"job {name} finished before the fault could land mid-flight; raise its steps"
    return now["step"]


def container_env(node: RealNode, pod: dict[str, Any]) -> dict[str, str] | None:
    """The environment the pod's first container's process runs with (what the kubelet and the device
    plugin gave it), read from /proc; None while it is not running."""
    statuses = pod.get("status", {}).get("containerStatuses") or []
    if not statuses or "running" not in statuses[0].get("state", {}):
        return None
    cid = statuses[0]["containerID"].split("://", 1)[1]
    for line in node.ctr("tasks", "ls").stdout.decode().splitlines()[1:]:
        task, pid, _status = (line.split() + ["", "", ""])[:3]
        if task == cid:
            try:
                raw = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                return None
            return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
    return None


def allocated_devices(pod_uid: str) -> list[str]:
    """The device IDs the kubelet's device manager recorded for a pod (its checkpoint file)."""
    doc = json.loads((KUBELET_ROOT / "device-plugins" / "kubelet_internal_checkpoint").read_text())
    return [d for e in doc["Data"]["PodDeviceEntries"] if e["PodUID"] == pod_uid
            for ids in e["DeviceIDs"].values() for d in ids]


def explain(cp: ControlPlane, node: RealNode, ns: str, name: str) -> str:
    """What a failed assertion about job `name` should show: its events, its pods and their logs."""
    pods = cp.get_json("pods", "-n", ns)["items"]
    logs = "\n".join(node.container_logs(ns, p["metadata"]["name"]) for p in pods)
    return (f"events: {[(e['reason'], e['message']) for e in events_of(cp, ns, name)]}\n"
            f"pods: {[(p['metadata']['name'], p['status'].get('phase')) for p in pods]}\n{logs[-8000:]}")
