"""Which namespaces and CXL nodes memstrata's swap layer uses, from the plan and the device plugin's env.

On a node the device plugin hands the container its namespaces in
MEMSTRATA_NVME_DEVICES (raw block devices) and its CXL NUMA nodes in
MEMSTRATA_CXL_NODES; those are the truth there, because the kubelet chose
them. A local run has no device plugin: the plan's NVMe namespace is the
scratch directory, so the stratum becomes one file-backed namespace per plan
namespace inside the run's own directory (sparse; deleted with it).

`swap_settings` is pure; `create_file_namespaces` is the one side effect.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel

from memstrata.api.inventory import ENV_CXL_NODES, ENV_NVME_DEVICES
from memstrata.api.strataplan import Plan
from memstrata.runtime.swap.layer import SwapSettings

__all__ = ["SwapStrata", "swap_settings", "create_file_namespaces", "namespace_bytes"]

# What one rank's stratum holds per parameter: 16-bit weights, then fp32 master,
# two Adam moments and the fp32 gradients streamed by sub-group (4 x 4 B).
_BYTES_PER_PARAMETER = 2 + 4 * 4


class SwapStrata(BaseModel):
    settings: SwapSettings
    file_namespaces: list[str] = []  # files to create (local runs) before the layer opens them
    file_bytes: int = 0
    source: str  # "device-plugin" | "plan" - for the report


def namespace_bytes(parameters: int, namespaces: int) -> int:
    """Size of each file-backed namespace: the state striped over all, with slack for alignment and headers."""
    total = int(parameters * _BYTES_PER_PARAMETER * 1.5) + (256 << 20)
    per = -(-total // max(namespaces, 1))
    return -(-per // (1 << 20)) * (1 << 20)


def _env_list(env: Mapping[str, str], key: str) -> list[str]:
    return [p.strip() for p in env.get(key, "").split(",") if p.strip()]


def swap_settings(plan: Plan, *, job: str, run_dir: Path, env: Mapping[str, str]) -> SwapStrata:
    """The swap layer's settings for this run. Raises ValueError naming the env/plan field when unusable."""
    cxl_env = _env_list(env, ENV_CXL_NODES)
    try:
        cxl = [int(n) for n in cxl_env] if cxl_env else list(plan.cxl_nodes)
    except ValueError:
        raise ValueError(f"{ENV_CXL_NODES}={env[ENV_CXL_NODES]!r}: expected comma-separated NUMA node numbers") \
            from None
    devices = _env_list(env, ENV_NVME_DEVICES)
    if devices:
        return SwapStrata(settings=SwapSettings(nvme=devices, job=job, cxl_nodes=cxl), source="device-plugin")
    if not plan.nvme_namespaces:
        raise ValueError("plan.nvme_namespaces is empty and MEMSTRATA_NVME_DEVICES is not set: memory.engine "
                         "memstrata needs an NVMe stratum (give `memstrata run` an --nvme-path)")
    files = [str(run_dir / f"nvme{i}.img") for i in range(len(plan.nvme_namespaces))]
    size = namespace_bytes(plan.parameters, len(files))
    return SwapStrata(settings=SwapSettings(nvme=files, job=job, cxl_nodes=cxl), file_namespaces=files,
                      file_bytes=size, source="plan")


def create_file_namespaces(strata: SwapStrata) -> None:
    """Create the sparse files of a local run's stratum (the run directory must exist)."""
    for path in strata.file_namespaces:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.ftruncate(fd, strata.file_bytes)
        finally:
            os.close(fd)
