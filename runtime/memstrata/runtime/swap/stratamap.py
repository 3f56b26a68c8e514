"""The swap layer's settings for one run, from the plan's bytes and the device plugin's env.

Where: on a node the device plugin hands the container its namespaces in
MEMSTRATA_NVME_DEVICES (raw block devices) and its CXL NUMA nodes in
MEMSTRATA_CXL_NODES; those are the truth there, because the kubelet chose
them, and the node's ranks share them out (rank r takes namespace i when
i % ranks == r). A local run has no device plugin: the stratum becomes one
sparse file-backed namespace per plan namespace inside the run's own
directory, which is the rank's own (each rank has its own run directory, so
two ranks never share a file).

How much, from the plan, so `memory.dramBudget` reaches the swap layer byte for byte:

- Optimizer state. The plan's DRAM bytes for optimizer state (categories master +
  optimizer on stratum dram) become `resident_state_bytes`: that many bytes of whole
  sub-groups stay in DRAM for good (memstrata.runtime.swap.resident) and only the rest
  streams through NVMe. The rotating cache keeps its one sub-group (the one the next,
  reversed, step walks first), which the plan counts with the locked buffers.
- Weights. The plan's non-NVMe bytes for the 16-bit weights become
  `resident_weight_bytes` when any of them spill: the parameter swapper keeps that
  many in DRAM.
- Placement: the activation checkpoints' pool and the pinned 16-bit weights each go to the
  stratum holding most of their category (CXL interleave or DRAM), one placement per pool.
- Nothing on NVMe: `no_nvme`, and the run opens no namespace at all.
- Namespace sizes (local runs): stock DeepSpeed offloads per group (`STOCK_GROUPS`),
  so for it a group with any byte on NVMe lives there whole; memstrata's engine puts
  there only what the plan spills, plus one sub-group and one tensor of slack, because
  whole sub-groups and tensors are what it keeps resident. Each namespace holds an
  even share plus the slack in `namespace_bytes`.

`swap_settings` is pure; `create_file_namespaces` is the one side effect.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel

from memstrata.api import strata
from memstrata.api.architecture import ModelArchitecture
from memstrata.api.inventory import ENV_CXL_NODES, ENV_NVME_DEVICES
from memstrata.api.strataplan import Plan
from memstrata.api.units import format_bytes
from memstrata.node.header import DATA_OFFSET
from memstrata.plan.accounting import CACHED_SUBGROUPS, STATE_BYTES_PER_ELEMENT
from memstrata.plan.buffers import param_staging_bytes
from memstrata.plan.assignment import STOCK_GROUPS
from memstrata.plan.stock import align_elements, largest_param, param_tensors, sub_group_size
from memstrata.runtime.swap.layer import SwapSettings

__all__ = ["SwapStrata", "create_file_namespaces", "namespace_bytes", "nvme_state_bytes", "resident_state_bytes",
           "resident_weight_bytes", "subgroup_state_bytes", "swap_settings"]

OPTIMIZER_STATE = ("master", "optimizer")
# The cache size the swap layer always had; the plan can only raise it.
# Extents one sub-group can own: master, two moments, and fp32 gradients where they are swapped.
EXTENTS_PER_SUBGROUP = 4
# The largest logical block of a namespace (and the block of a file-backed one): each extent is padded to it.
BLOCK_BYTES = 4096
MiB = 1 << 20


class SwapStrata(BaseModel):
    settings: SwapSettings
    file_namespaces: list[str] = []  # files to create (local runs) before the layer opens them
    file_bytes: int = 0
    source: str  # "device-plugin" | "plan" - for the report


def _bytes(plan: Plan, categories: Iterable[str], stratum: str) -> int:
    wanted = set(categories)
    return sum(c.on(stratum) for c in plan.categories if c.category in wanted)


def subgroup_state_bytes(arch: ModelArchitecture, ranks: int = 1) -> int:
    """The most DRAM one cached sub-group of one rank can hold.

    ZeRO-3 closes a sub-group once it reaches sub_group_size elements (the value
    memstrata.runtime.train.dsconfig configures), so it overshoots by less than one
    (partitioned) tensor; each of its three fp32 tensors is padded to the swapper's
    4 KiB alignment."""
    elements = sub_group_size(arch) + -(-largest_param(arch) // max(ranks, 1))
    return align_elements(elements) * STATE_BYTES_PER_ELEMENT


def resident_state_bytes(plan: Plan) -> int:
    """Optimizer state each rank keeps in DRAM for good: the plan's DRAM bytes for master + moments, split
    evenly over the node's ranks (the plan's ranks_per_node: the split it was counted with)."""
    return _bytes(plan, OPTIMIZER_STATE, "dram") // plan.ranks_per_node


def resident_weight_bytes(plan: Plan) -> int:
    """16-bit weights each rank keeps in DRAM (or CXL) although some spill to NVMe (per rank, as above)."""
    kept = sum(_bytes(plan, ("weights",), s.name) for s in strata.registry() if s.addressable)
    return kept // plan.ranks_per_node


def nvme_state_bytes(plan: Plan, arch: ModelArchitecture | None = None) -> int:
    """Bytes the runtime keeps on the NVMe stratum. Stock: every offload group with any byte there, whole.
    memstrata: what the plan spills, plus one sub-group of optimizer state and one 16-bit tensor, since it
    keeps whole sub-groups and tensors resident and so may spill up to that much more than the plan's bytes."""
    if plan.engine == "memstrata":
        spilled = plan.bytes_on("nvme")
        if not spilled or arch is None:
            return spilled
        return spilled + subgroup_state_bytes(arch) + align_elements(largest_param(arch)) * 4
    total, counted = 0, set[str]()
    for c in plan.categories:
        if c.category in counted or not c.on("nvme"):
            continue
        group = STOCK_GROUPS.get(c.category, (c.category,))
        counted.update(group)
        total += sum(g.bytes for g in plan.categories if g.category in group)
    return total


def unplanned_namespace_bytes(parameters: int) -> int:
    """NVMe bytes for one rank when `initialize` is called directly, with no plan (a user's own script):
    every category that can be on NVMe is — 16-bit weights, fp32 master, two moments and fp32
    gradients (2 + 4 x 4 B per parameter) — with half again and 256 MiB of slack, since nothing says
    how the state is cut into extents."""
    return int(parameters * (2 + 4 * 4) * 1.5) + (256 << 20)


def namespace_bytes(plan: Plan, arch: ModelArchitecture, namespaces: int, stripe_bytes: int) -> int:
    """Size of each file-backed namespace: an even share of `nvme_state_bytes`, plus slack, in whole MiB.

    Slack: DATA_OFFSET ahead of the data (the header and its reserved area), and per extent one
    BLOCK_BYTES of padding; striped over several namespaces, the first one also takes up to two more
    stripe units per extent (a tensor is cut into stripe units dealt round-robin from the first).
    A sub-group holds at least one tensor, so there are at most as many sub-groups as tensors."""
    n = max(namespaces, 1)
    tensors = param_tensors(arch)
    extents = tensors + EXTENTS_PER_SUBGROUP * tensors
    per_extent = BLOCK_BYTES + (2 * stripe_bytes if n > 1 else 0)
    size = DATA_OFFSET + -(-nvme_state_bytes(plan, arch) // n) + extents * per_extent
    return -(-size // MiB) * MiB


def _env_list(env: Mapping[str, str], key: str) -> list[str]:
    return [p.strip() for p in env.get(key, "").split(",") if p.strip()]


def io_token_scope(env: Mapping[str, str]) -> str:
    """The I/O-token scope of a rank torch elastic started: its run and node (the agent's group rank); empty for
    a process alone."""
    run = env.get("TORCHELASTIC_RUN_ID")
    if not run:
        return ""
    return hashlib.sha256(f"{run}/{env.get('GROUP_RANK', '0')}".encode()).hexdigest()[:16]


def _weight_bytes(plan: Plan) -> int:
    """Bytes per element of the plan's 16-bit (or fp32) weights, from its weights category: a node holds
    ranks_per_node / world_size of (parameters + LoRA adapters) x w."""
    held = plan.parameters + (plan.trainable_parameters or 0)
    weights = sum(c.bytes for c in plan.categories if c.category == "weights")
    per = weights * plan.world_size / max(1, plan.ranks_per_node) / max(1, held)
    return 4 if per > 3 else 2


def swap_settings(plan: Plan, arch: ModelArchitecture, *, job: str, run_dir: Path, env: Mapping[str, str]
                  ) -> SwapStrata:
    """The swap layer's settings for one rank of a node of the plan's `ranks_per_node` ranks, `run_dir` being that
    rank's own directory. Raises ValueError naming the env/plan field when unusable."""
    ranks = plan.ranks_per_node
    cxl_env = _env_list(env, ENV_CXL_NODES)
    try:
        cxl = [int(n) for n in cxl_env] if cxl_env else list(plan.cxl_nodes)
    except ValueError:
        raise ValueError(f"{ENV_CXL_NODES}={env[ENV_CXL_NODES]!r}: expected comma-separated NUMA node numbers") \
            from None
    # One I/O token for the node's ranks of this run (the update's I/O, one rank at a time, as MLP-Offload
    # found best); memstrata.runtime.swap.handle keeps it from ever deadlocking ranks that meet in collectives.
    spills_weights = _bytes(plan, ("weights",), "nvme") > 0
    # The activation pool goes where the plan put most of the checkpoints (one placement per pool).
    on_cxl = _bytes(plan, ("checkpoints",), "cxl") >= _bytes(plan, ("checkpoints",), "dram")
    weights_on_cxl = _bytes(plan, ("weights",), "cxl") >= _bytes(plan, ("weights",), "dram")
    base = SwapSettings(job=job, ranks_per_node=ranks, cxl_nodes=cxl, activations_on_cxl=on_cxl,
                        weights_on_cxl=weights_on_cxl,
                        cache_subgroups=CACHED_SUBGROUPS,
                        resident_state_bytes=resident_state_bytes(plan),
                        prefetch_subgroups=plan.optimizer_read_ahead,
                        resident_weight_bytes=resident_weight_bytes(plan) if spills_weights else None,
                        param_staging_bytes=param_staging_bytes(arch, _weight_bytes(plan)),
                        io_token_scope=io_token_scope(env), delayed_update=plan.delayed_update)
    devices = _env_list(env, ENV_NVME_DEVICES)
    if devices:
        if len(devices) < ranks:
            raise ValueError(f"{ENV_NVME_DEVICES}: {len(devices)} namespaces cannot serve the node's {ranks} ranks "
                             "(each rank needs at least one of its own): raise memory.nvmeNamespaces")
        return SwapStrata(settings=base.model_copy(update={"nvme": devices}), source="device-plugin")
    if not plan.nvme_namespaces:
        on_nvme = plan.bytes_on("nvme")
        if on_nvme:
            raise ValueError(f"plan.nvme_namespaces is empty but plan.categories place {format_bytes(on_nvme)} on "
                             "nvme: a plan that uses the NVMe stratum must name its namespaces")
        # Everything fits in DRAM: a valid plan of the memstrata engine, run with no namespace at all.
        return SwapStrata(settings=base.model_copy(update={"no_nvme": True}), source="plan")
    files = [str(run_dir / f"nvme{i}.img") for i in range(len(plan.nvme_namespaces))]
    size = namespace_bytes(plan, arch, len(files), base.stripe_bytes)
    # Sized for the whole state, not this rank's 1/world share: the files are sparse, so the slack costs nothing.
    return SwapStrata(settings=base.model_copy(update={"nvme": files, "nvme_shared": False}), file_namespaces=files,
                      file_bytes=size, source="plan")


def create_file_namespaces(strata: SwapStrata) -> None:
    """Create the sparse files of a local run's stratum (the run directory must exist)."""
    for path in strata.file_namespaces:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.ftruncate(fd, strata.file_bytes)
        finally:
            os.close(fd)
