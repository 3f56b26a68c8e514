"""memstrata's devices under Dynamic Resource Allocation (`resource.k8s.io/v1`): the one place their names live.

The node agent publishes them (memstrata.nodeagent.draslice), the chart ships their DeviceClasses, the
operator will claim them: all three read the names below, so none can disagree.

- **Driver** `dra.memstrata.dev`: one ResourceSlice per node, pool = the node's name.
- **NVMe namespaces** (DeviceClass `nvme-ns.memstrata.dev`): a device per free namespace, named after its
  block device and, when the kernel reports one, its WWID (a namespace renamed by a reboot is a new device,
  never the old name pointing at other data). Attributes: kind, namespace, controller, model, numaNode,
  blockSize, loop, wwid; capacity `size` in bytes.
- **CXL memory** (DeviceClass `cxl.memstrata.dev`): a device per CPU-less CXL NUMA node, shared by as many
  claims as its bytes allow (consumable capacity, 2 MiB steps: what the kernel pages it in). Attributes:
  kind, numaNode, expanders, region; capacity `memory` in bytes.

Attribute names are unqualified in a slice; a CEL selector reads them as
`device.attributes["dra.memstrata.dev"].<name>`.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any

DRIVER = "dra.memstrata.dev"
NVME_CLASS = "nvme-ns.memstrata.dev"
CXL_CLASS = "cxl.memstrata.dev"
KIND_NVME = "nvme-ns"
KIND_CXL = "cxl"
# Capacity names (DRA QualifiedNames) and the step CXL bytes are consumed in.
SIZE = "size"
MEMORY = "memory"
CXL_STEP_BYTES = 2 << 20
# resource.k8s.io limits: a device name is a DNS label; a string attribute holds at most 64 characters.
MAX_NAME = 63
MAX_STRING = 64
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")
# Set by the operator on a training container whose claim holds namespaces: how many CDI must have given it.
ENV_CLAIMED_NAMESPACES = "MEMSTRATA_CLAIMED_NAMESPACES"


def dns_label(text: str) -> str:
    """`text` as a DNS label: lowercase, [a-z0-9-], no dash at either end, at most 63 characters."""
    label = _NOT_LABEL.sub("-", text.lower()).strip("-")[:MAX_NAME].strip("-")
    if not label:
        raise ValueError(f"{text!r} has nothing a device name can keep")
    return label


def namespace_device_name(name: str, wwid: str | None) -> str:
    """nvme0n1 -> `nvme0n1`, or `nvme0n1-<8 hex of its WWID>` when it has one."""
    if not wwid:
        return dns_label(name)
    return f"{dns_label(name)[:MAX_NAME - 9]}-{hashlib.sha256(wwid.encode()).hexdigest()[:8]}"


def cxl_device_name(numa_node: int) -> str:
    return f"cxl-node{numa_node}"


def selector(kind: str) -> str:
    """The CEL expression a DeviceClass selects `kind`'s devices with."""
    return f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].kind == "{kind}"'


def device_classes() -> list[dict[str, Any]]:
    """The DeviceClasses the chart ships (its template is held equal to these by a test)."""
    return [{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
             "spec": {"selectors": [{"cel": {"expression": selector(kind)}}]}}
            for name, kind in ((NVME_CLASS, KIND_NVME), (CXL_CLASS, KIND_CXL))]


def namespaces_missing(claimed: str | None, granted: int) -> str | None:
    """Why a container whose claim holds `claimed` namespaces (ENV_CLAIMED_NAMESPACES; None: not a claim's) but
    was given `granted` must not run, or None. A runtime that does not apply CDI specs starts the container without
    them, and the engine must not quietly put the NVMe stratum on the container's own filesystem instead."""
    if claimed is None or not claimed.isdigit() or granted >= int(claimed):
        return None
    return (f"the job's ResourceClaim holds {claimed} NVMe namespace(s) but the container was given {granted} "
            "(MEMSTRATA_NVME_DEVICES is what the claim's CDI spec sets): the node's container runtime must apply "
            "CDI specs (containerd >= 2.0, or 1.7 with enable_cdi = true; CRI-O >= 1.28)")
