"""(Imported by the operator tests, not a conftest: a plain module keeps the names explicit.)

Builders of API-shaped dicts for the operator's pure logic: nodes exactly as the node agent
publishes them (memstrata.api.render_node), jobs as the API server returns them, pods as the
kubelet (or kwok) reports them."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import yaml

from memstrata.api import NodeInventory, render_node

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def inventory(name: str, dram_gib: int, cxl_gib: int = 0, nvme: int = 2, gpus: int = 1,
              hbm_gib: int = 80) -> NodeInventory:
    return NodeInventory.model_validate({
        "hostname": name,
        "numaNodes": [{"id": 0, "kind": "dram", "cpus": [0, 1], "memoryBytes": f"{dram_gib}Gi"}]
        + ([{"id": 1, "kind": "cxl", "memoryBytes": f"{cxl_gib}Gi"}] if cxl_gib else []),
        "cxlNodes": [{"numaNode": 1, "memoryBytes": f"{cxl_gib}Gi"}] if cxl_gib else [],
        "nvmeNamespaces": [{"name": f"nvme{i}n1", "sizeBytes": "3.84T", "free": True} for i in range(nvme)],
        "gpus": [{"index": i, "hbmBytes": f"{hbm_gib}Gi"} for i in range(gpus)],
    })


def node_dict(name: str, inv: NodeInventory | None, *, ready: bool = True, cordoned: bool = False,
              taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    rendered = render_node(inv) if inv else {"labels": {}, "annotations": {}, "capacity": {}}
    capacity = {"cpu": "32", "memory": "256Gi", "pods": "110", **rendered["capacity"]}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **rendered["labels"]},
                     "annotations": dict(rendered["annotations"])},
        "spec": {"unschedulable": cordoned, "taints": taints or []},
        "status": {"capacity": capacity, "allocatable": dict(capacity),
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def job_dict(name: str = "llama", *, spec_file: str = "examples/finetune.yaml", status: dict[str, Any] | None = None,
             run_policy: dict[str, Any] | None = None, labels: dict[str, str] | None = None,
             uid: str = "uid-1") -> dict[str, Any]:
    doc = yaml.safe_load((REPO / spec_file).read_text())
    spec = doc["spec"]
    spec["runPolicy"] = {**spec.get("runPolicy", {}), **(run_policy or {})}
    return {
        "apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob",
        "metadata": {"name": name, "namespace": "team-a", "uid": uid, "resourceVersion": "1",
                     "creationTimestamp": "2026-01-01T12:00:00Z", "labels": labels or {}},
        "spec": spec,
        "status": status or {},
    }


def pod_dict(name: str, attempt: int, phase: str = "Pending", *, node: str | None = None, exit_code: int | None = None,
             deleting: bool = False, unschedulable: str | None = None,
             requests: dict[str, str] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if exit_code is not None:
        status["containerStatuses"] = [{"name": "runtime", "state": {"terminated": {
            "exitCode": exit_code, "reason": "Error" if exit_code else "Completed",
            "finishedAt": "2026-01-01T12:05:00Z"}}}]
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": unschedulable}]
    meta: dict[str, Any] = {"name": name, "namespace": "team-a",
                            "labels": {"memstrata.dev/job-uid": "uid-1", "memstrata.dev/attempt": str(attempt)}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T12:06:00Z"
    res = {"requests": requests or {}, "limits": requests or {}}
    return {"metadata": meta, "spec": {"nodeName": node, "containers": [{"name": "runtime", "resources": res}]},
            "status": status}


def at(seconds: float = 0.0) -> datetime:
    return T0 + timedelta(seconds=seconds)
