"""Per-tensor NUMA placement: which host nodes each kind of swap buffer lives on.

The CXL study found that the CPU optimizer step slows ~4x when its operands
sit in CXL memory, while data that is only ever DMA'd (parameter staging,
offloaded activation checkpoints) runs at 97-100% of DRAM speed when striped
over the CXL nodes. So: optimizer operands (fp32 master, moments, the
gradients being consumed, the optimizer cache) are bound to DRAM nodes;
DMA-only buffers are interleaved over the CXL nodes when the node has any,
else over DRAM. Pure: no I/O; the pool applies the answer with mbind.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from memstrata.runtime.strata.numa import Policy

__all__ = ["TensorKind", "Placement", "place"]


class TensorKind(str, Enum):
    OPTIMIZER = "optimizer"  # fp32 master weights, Adam moments, fp32 gradients: CPU-optimizer operands
    PARAM_STAGING = "param"  # 16-bit parameter partitions on their way to/from NVMe: DMA only
    WEIGHTS = "weights"  # 16-bit partitions kept in host memory: DMA to the GPU; the CPU writes them once a step
    ACTIVATIONS = "activations"  # offloaded activation checkpoints: DMA only


@dataclass(frozen=True)
class Placement:
    nodes: tuple[int, ...]  # empty: leave the process's policy alone (single-node machines)
    policy: Policy


def place(kind: TensorKind, *, dram_nodes: Sequence[int], cxl_nodes: Sequence[int]) -> Placement:
    """Where buffers of `kind` go on a node with these DRAM and CXL (CPU-less) NUMA nodes."""
    dram, cxl = tuple(sorted(dram_nodes)), tuple(sorted(cxl_nodes))
    if set(dram) & set(cxl):
        raise ValueError(f"NUMA nodes {sorted(set(dram) & set(cxl))} are listed as both DRAM and CXL")
    if not cxl and len(dram) <= 1:
        # One memory node: nothing to choose, so no mbind. That matters in a container: the runtime's
        # default seccomp profile refuses mbind without CAP_SYS_NICE, which PodSecurity `restricted` never grants.
        return Placement((), Policy.BIND)
    if kind is TensorKind.OPTIMIZER or not cxl:
        if len(dram) == 1:
            # Beside CXL nodes: first-touch would put pages on a CXL node once DRAM runs short.
            return Placement(dram, Policy.BIND)
        # Several DRAM nodes: the optimizer threads run everywhere, so spread its operands.
        return Placement(dram, Policy.INTERLEAVE)
    return Placement(cxl, Policy.INTERLEAVE)
