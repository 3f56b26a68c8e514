"""What one rank's swap layer reports about its strata (`SwapLayer.status()`).

The JSON form (`wire()`, camelCase like the API) is read by the run report, benchmarks/offload/run.py and
the offload tests; its keys are a contract. Built per report from live counters; nothing here moves data.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field

from memstrata.api.base import ApiModel

__all__ = ["ActivationStatus", "DramStatus", "GradientStatus", "MovedBytes", "NvmeStatus", "OverlapStatus",
           "SwapStatus"]


class _Status(ApiModel):
    def wire(self) -> dict[str, Any]:
        """camelCase JSON with every key present: a null says "not in use", which a reader must see."""
        return self.model_dump(mode="json", by_alias=True)


class MovedBytes(_Status):
    written: int
    read: int


class NvmeStatus(_Status):
    namespaces: list[str] = Field(description="Device or file paths of this rank's namespaces.")
    bytes_written: int = Field(description="Device counters: every byte the engine wrote.")
    bytes_read: int
    bytes_live: int = Field(description="State held on the stratum now (padded extents).")
    bytes_live_peak: int = Field(description="The most state held at once: the stratum's peak use.")
    extents_live: int
    by_kind: dict[str, MovedBytes] = Field(description="Per swapper: param, optimizer.")
    io_token_wait_seconds: float = Field(description="Time this rank waited for the node's I/O token.")
    io_token_bypasses: int = Field(0, ge=0, description="Update I/O done without the token after a bounded wait "
                                                        "(a peer held it across a collective).")


class GradientStatus(_Status):
    """Gradients kept in ZeRO-3's DRAM flat buffer (memstrata.runtime.swap.gradients)."""

    dtype: str = Field(description="The buffer's dtype, e.g. bfloat16.")
    nbytes: int = Field(alias="bytes", description="Size of the flat buffer.")
    widened_bytes: int = Field(description="fp32 bytes widened into update buffers, in all.")


class DramStatus(_Status):
    locked_bytes: int = Field(description="Pool regions, mlock'ed.")
    locked_peak_in_use: int
    trimmed_bytes: int = Field(description="Given back after updates, in all.")
    pinned_bytes: int = Field(0, description="The host buffers DeepSpeed pins (16-bit weights kept in host memory, "
                                             "the flat gradient buffer), served exactly from the swap layer's pools "
                                             "(memstrata.runtime.swap.pinning); in use now.")
    optimizer_cache_bytes: int
    resident_state_bytes: int = Field(0, description="Optimizer state of the sub-groups kept in DRAM for good "
                                                     "(never on NVMe), fp32 master + moments.")
    resident_subgroups: int = Field(0, description="How many sub-groups those are.")
    resident_weight_bytes: int = Field(0, description="16-bit parameter partitions kept in DRAM although the "
                                                      "weights are offloaded to NVMe.")
    prefetch_hits: int = Field(0, description="Sub-group reads that were already in flight when the update "
                                              "reached them (the pipelined update).")
    optimizer_cache_hits: int
    sliced_subgroups: int = Field(0, description="Sub-groups of one tensor larger than a slice, updated a slice at "
                                                 "a time (memstrata.runtime.swap.sliced).")
    slices_updated: int = Field(0, description="Slices those updates ran, in all.")
    sub_group_orders: list[list[int]] = Field(description="Update order of the last walks (at most 8).")
    gradients: GradientStatus | None = Field(description="None: gradients are not kept in DRAM by memstrata.")
    vm_locked_bytes: int = Field(description="The kernel's VmLck for this process.")
    huge_page_tensors: bool | None = Field(None, description="Whether torch's CPU blocks of 2 MiB or more are "
                                           "advised huge pages (memstrata.runtime.swap.hostheap); None: the kernel "
                                           "offers none, or the layer was not opened by the runtime.")


class ActivationStatus(_Status):
    """Activation checkpoints offloaded by memstrata.runtime.swap.activations."""

    stratum: str = Field(description="cxl: interleaved over the plan's CXL nodes; dram otherwise.")
    numa_nodes: list[int] = Field(description="The nodes their pages are placed on (empty: the process's policy).")
    live_peak_bytes: int = Field(description="The most checkpoint bytes held at once: the plan's `checkpoints`.")
    offloaded_bytes: int = Field(description="Copied off the compute device, in all.")
    returned_bytes: int = Field(description="Copied back for backward, in all.")
    prefetched: int = Field(description="Checkpoints already on their way back when backward reached them.")
    tensors: int = Field(description="Checkpoints offloaded, in all.")
    locked_bytes: int = Field(description="The activation pool's regions now.")


class OverlapStatus(_Status):
    """The optimizer update run beside the next forward (memstrata.runtime.swap.overlap)."""

    on: bool = Field(description="Whether updates run beside the forward; false: each runs in place.")
    mode: str = Field("beside the forward", description="'beside the forward' (exact), or 'delayed' (asked for by "
                                                        "name: each update beside the next forward and backward).")
    refused: str = Field("", description="Why they do not (on false), in words.")
    updates: int = Field(0, description="Updates that ran beside a forward, in all.")
    update_seconds: float = Field(0.0, description="Their time on the update thread, in all.")
    forward_waits: int = Field(0, description="Gathers that waited for their sub-group's update.")
    forward_wait_seconds: float = Field(0.0, description="The forward's time waiting for them, in all.")
    join_wait_seconds: float = Field(0.0, description="Time waiting for updates to end (when the forward ended, "
                                                      "before a checkpoint or the next step), in all.")
    backward_waits: int = Field(0, description="Delayed: gradient writes that waited for the update to read the "
                                               "sub-group's gradients of the step before.")
    backward_wait_seconds: float = Field(0.0, description="Delayed: the backward's time waiting for them, in all.")
    late_subgroups: int = Field(0, description="Delayed: sub-groups whose new weights went through a shadow (the "
                                               "backward still read the old ones), in all.")
    shadow_peak_bytes: int = Field(0, description="Delayed: the most bytes of shadows held at once.")


class SwapStatus(_Status):
    nvme: NvmeStatus
    dram: DramStatus
    update_overlap: OverlapStatus = Field(default_factory=lambda: OverlapStatus(on=False),
                                          description="The update beside the forward.")
    activations: ActivationStatus | None = Field(None, description="None: no activation was offloaded.")
