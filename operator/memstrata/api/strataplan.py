"""The plan: where every byte of a job lives on one node, per category and stratum.

The planner (`memstrata.plan`) produces it; the operator renders it into the
runtime config, and the runtime sizes its strata from it. Its home is the API
because it is a contract that crosses from the operator to the pod.

The engine: the job chooses it (spec.memory.engine), the planner plans for it and records it in
`Plan.engine`, and from there on the plan is its one home: the runtime runs the engine its plan was
made for. `stock_swap_refusal` is the one statement of why stock DeepSpeed cannot run a plan on raw
namespaces: the operator's placement, the pod and a local run all say it with these words.
"""
from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, Field

__all__ = ["STOCK_SWAP_FIX", "Allocation", "CategoryPlan", "Engine", "Plan", "Shortfall", "StratumUse"]

Engine = Literal["memstrata", "deepspeed"]
# What a job refused for stock DeepSpeed's swap target can do instead.
STOCK_SWAP_FIX: Final = ("use memory.engine: memstrata, whose engine writes raw namespaces directly, or "
                         "memory.nvmeNamespaces: 0 (with DRAM enough for the plan) to offload to the CPU only")


class Allocation(BaseModel):
    stratum: str
    bytes: int = Field(ge=0)


class CategoryPlan(BaseModel):
    category: str
    description: str
    bytes: int = Field(ge=0, description="On the node: all of its ranks together.")
    placement: list[Allocation] = []
    rank_bytes: int = Field(0, ge=0, description="Of one rank (bytes / ranks_per_node); 0 in plans written "
                                                 "before it was recorded.")

    def on(self, stratum: str) -> int:
        return sum(a.bytes for a in self.placement if a.stratum == stratum)


class Shortfall(BaseModel):
    stratum: str
    category: str
    missing_bytes: int = Field(ge=0)
    message: str


class StratumUse(BaseModel):
    stratum: str
    capacity: int = Field(ge=0)
    used: int = Field(ge=0)
    detail: str = ""


class Plan(BaseModel):
    parameters: int
    trainable_parameters: int | None = Field(
        None, description="Parameters that train, when not all do (training.method lora: the adapters'); their "
                          "gradients, fp32 master weights and Adam moments are all the optimizer state there is.")
    engine: Engine = Field(description="The engine the plan was made for (spec.memory.engine): the one the "
                                       "runtime runs.")
    activation_checkpointing: bool = Field(
        True, description="Whether the runtime must turn on gradient checkpointing: the working set was "
                          "counted with one layer's live activations (true) or every layer's (false).")
    layer_major: bool = Field(
        False, description="Whether the runtime runs every micro-batch of a step through a layer before the next "
                           "(memstrata.api.layermajor): the checkpoints were counted for gradientAccumulation "
                           "micro-batches at once.")
    delayed_update: bool = Field(
        False, description="Whether the runtime runs the delayed update (spec.training.update delayed): the weights "
                           "were counted with their 16-bit shadows (memstrata.api.updatemode).")
    feasible: bool
    categories: list[CategoryPlan]
    strata: list[StratumUse]
    shortfalls: list[Shortfall] = []
    nvme_namespaces: list[str] = []
    cxl_nodes: list[int] = []
    requests: dict[str, int] = Field(default_factory=dict, description="Extended resources the pod must request.")
    update_io_seconds: float = Field(0.0, description="Estimated NVMe time per optimizer step.")
    sub_group_elements: int | None = Field(
        None, description="memstrata's optimizer sub-group unit (elements): about a layer, or less where a tight "
                          "DRAM budget needs smaller update buffers; the runtime's ZeRO-3 sub_group_size. None: "
                          "the stock engine.")
    optimizer_read_ahead: int = Field(
        0, ge=0, description="Streamed optimizer sub-groups memstrata's update reads ahead of the one it updates "
                             "(1: read of i+1, Adam on i and write-back of i-1 overlap, one more sub-group of locked "
                             "buffers; 0 where the budget cannot spare that buffer).")
    # The job's shape across nodes: the plan is for ONE node of `nodes`, running `ranks_per_node` ranks;
    # ZeRO-3 partitions the model state over all `world_size` of them.
    nodes: int = Field(1, ge=1, description="Nodes of the job; this plan is for one of them.")
    ranks_per_node: int = Field(1, ge=1, description="Training processes on each node.")
    world_size: int = Field(1, ge=1, description="Training processes of the whole job (nodes x ranks_per_node).")
    global_batch: int = Field(0, ge=0, description="Sequences per optimizer step over the whole job (microBatch x "
                                                   "gradientAccumulation x world_size); 0 in plans written before "
                                                   "it was recorded.")
    rank_bytes: dict[str, int] = Field(default_factory=dict, description="Bytes of one rank per stratum (each rank "
                                                                         "of the node holds the same).")
    notes: list[str] = Field(default_factory=list, description="Why the plan asks for what it asks, for people.")

    def category(self, name: str) -> CategoryPlan:
        return next(c for c in self.categories if c.category == name)

    def bytes_on(self, stratum: str) -> int:
        return sum(c.on(stratum) for c in self.categories)

    def slow_bytes(self) -> tuple[int, int]:
        """(bytes on NVMe, bytes on CXL): the operator prefers nodes where these are smallest."""
        return self.bytes_on("nvme"), self.bytes_on("cxl")

    def offload_device(self, *categories: str) -> str:
        """How stock DeepSpeed must be configured for these categories: nvme if any byte is there."""
        return "nvme" if any(self.category(c).on("nvme") for c in categories) else "cpu"

    def deepspeed_swapped(self) -> list[str]:
        """What stock DeepSpeed would have to swap to NVMe under this plan ("parameters", "optimizer
        state"): it swaps to files under a directory, so a raw namespace cannot take them."""
        return [name for name, device in (("parameters", self.offload_device("weights")),
                                          ("optimizer state", self.offload_device("master", "optimizer")))
                if device == "nvme"]

    def stock_swap_refusal(self) -> str | None:
        """Why stock DeepSpeed cannot run this plan where the NVMe stratum is raw namespaces, or None (another
        engine, or nothing it would swap to NVMe)."""
        swapped = self.deepspeed_swapped() if self.engine == "deepspeed" else []
        if not swapped:
            return None
        return (f"spec.memory.engine: deepspeed cannot swap the {' and '.join(swapped)} the plan puts on NVMe to raw "
                "namespaces: stock DeepSpeed writes what it offloads as files under a directory (nvme_path), a "
                "namespace is a raw device without a filesystem, and memstrata does not create one on a device; "
                f"{STOCK_SWAP_FIX}")

    def verdict(self) -> str:
        if self.feasible:
            return "fits"
        return "; ".join(s.message for s in self.shortfalls)
