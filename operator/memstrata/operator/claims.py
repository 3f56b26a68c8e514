"""A job's devices as DRA claims (the operator's `--device-api dra`). Pure: a plan in, objects out.

One ResourceClaimTemplate per job, named after it and owned by it; each pod of each attempt gets its own
claim from it (the kubelet's resourceclaim controller makes it, and deletes it with the pod), and the
scheduler picks the devices. What the template asks for, from the plan:

- **namespaces** (`nvme-ns.memstrata.dev`): as many as the plan counts, each holding at least its share
  of the plan's NVMe bytes (the engine stripes round-robin over them) plus the engine's header area.
  In order of preference (a prioritized list, `firstAvailable`): all on one NUMA node and on distinct
  controllers; on one NUMA node; on distinct controllers; any. One namespace: just the size.
- **CXL bytes** (`cxl.memstrata.dev`): one device per CXL node the plan interleaves over, each giving its
  share of the plan's CXL bytes (consumable capacity: other claims share the node), on distinct nodes.
- **GPUs**, where the cluster publishes them through DRA (`--gpu-device-class`): the plan's count of that class.

The pod's container then requests none of these as extended resources; it names the claim instead.
"""
from __future__ import annotations

import json
from typing import Any

from memstrata.api import dra
from memstrata.api.inventory import RESOURCE_GPU, RESOURCE_NVME
from memstrata.api.strata import RESOURCE_CXL_GIB
from memstrata.api.strataplan import Plan
from memstrata.node.header import DATA_OFFSET

CLAIM = "devices"  # the pod's name for its claim (pod.spec.resourceClaims[].name)
# Beside the pod: the counts its claim asks for, for the operator's own room-now arithmetic (nodes.pod_use).
ANNOTATION_REQUESTS = "memstrata.dev/claimed-devices"
HEADER_AREA = DATA_OFFSET  # where a namespace's data starts, behind the engine's header
# The extended resources the claim replaces.
CLAIMED_RESOURCES = (RESOURCE_NVME, RESOURCE_CXL_GIB)


def _qualified(name: str) -> str:
    return f"{dra.DRIVER}/{name}"


def namespace_share(plan: Plan, count: int) -> int:
    """The bytes each of `count` namespaces must hold: its round-robin share of the plan's NVMe bytes, and the
    engine's header area."""
    return -(-plan.bytes_on("nvme") // count) + HEADER_AREA


def _namespace_request(plan: Plan, count: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    size = {"cel": {"expression": f'device.capacity["{dra.DRIVER}"].{dra.SIZE}.compareTo('
                                  f'quantity("{namespace_share(plan, count)}")) >= 0'}}
    exact = {"deviceClassName": dra.NVME_CLASS, "allocationMode": "ExactCount", "count": count, "selectors": [size]}
    if count == 1:
        return {"name": "namespaces", "exactly": exact}, []
    options = ("numa-spread", "numa", "spread", "any")
    constraints = [
        {"requests": ["namespaces/numa-spread"], "matchAttribute": _qualified("numaNode")},
        {"requests": ["namespaces/numa-spread"], "distinctAttribute": _qualified("controller")},
        {"requests": ["namespaces/numa"], "matchAttribute": _qualified("numaNode")},
        {"requests": ["namespaces/spread"], "distinctAttribute": _qualified("controller")},
    ]
    return {"name": "namespaces", "firstAvailable": [{"name": o, **exact} for o in options]}, constraints


def _cxl_request(plan: Plan) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    nodes = max(len(plan.cxl_nodes), 1)
    step = dra.CXL_STEP_BYTES
    share = -(-plan.bytes_on("cxl") // nodes // step) * step or step
    request = {"name": "cxl", "exactly": {"deviceClassName": dra.CXL_CLASS, "allocationMode": "ExactCount",
                                          "count": nodes, "capacity": {"requests": {dra.MEMORY: str(share)}}}}
    spread = [{"requests": ["cxl"], "distinctAttribute": _qualified("numaNode")}] if nodes > 1 else []
    return request, spread


def device_requests(plan: Plan, gpu_class: str | None = None) -> dict[str, Any]:
    """The `spec.devices` of a job's claim; empty requests when the plan needs nothing claimed."""
    requests: list[dict[str, Any]] = []
    constraints: list[dict[str, Any]] = []
    if count := plan.requests.get(RESOURCE_NVME, 0):
        request, rules = _namespace_request(plan, count)
        requests.append(request)
        constraints += rules
    if plan.requests.get(RESOURCE_CXL_GIB, 0) and plan.bytes_on("cxl"):
        request, rules = _cxl_request(plan)
        requests.append(request)
        constraints += rules
    if gpu_class and (gpus := plan.requests.get(RESOURCE_GPU, 0)):
        requests.append({"name": "gpus", "exactly": {"deviceClassName": gpu_class, "allocationMode": "ExactCount",
                                                     "count": gpus}})
    return {"requests": requests, **({"constraints": constraints} if constraints else {})}


def claimed_resources(gpu_class: str | None = None) -> tuple[str, ...]:
    """The extended resources a claim replaces in the container's requests."""
    return CLAIMED_RESOURCES + ((RESOURCE_GPU,) if gpu_class else ())


def claimed_counts(plan: Plan, gpu_class: str | None = None) -> dict[str, int]:
    """What the claim holds, in the extended resources' units (the pod's ANNOTATION_REQUESTS)."""
    return {r: n for r in claimed_resources(gpu_class) if (n := plan.requests.get(r, 0))}


def template(meta: dict[str, Any], plan: Plan, gpu_class: str | None = None) -> dict[str, Any] | None:
    """The job's ResourceClaimTemplate (`meta`: its metadata), or None when the plan claims nothing."""
    devices = device_requests(plan, gpu_class)
    if not devices["requests"]:
        return None
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": meta,
            "spec": {"metadata": {"labels": dict(meta.get("labels") or {})}, "spec": {"devices": devices}}}


def pod_parts(template_name: str, plan: Plan, gpu_class: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """(the pod's `resourceClaims` entry, its annotation of the claimed counts)."""
    return ({"name": CLAIM, "resourceClaimTemplateName": template_name},
            {ANNOTATION_REQUESTS: json.dumps(claimed_counts(plan, gpu_class), sort_keys=True)})
