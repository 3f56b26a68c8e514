"""How many bytes each category of a fine-tuning job needs. Pure arithmetic, no I/O.

Every formula here is stated in the docstring of the function that computes it,
so a reader can check a number in `memstrata plan` by hand.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.finetunejob import Engine, Precision
from memstrata.plan.stock import pinned_pool_bytes

Category = Literal["working", "pinned", "gradients", "master", "optimizer", "weights", "checkpoints"]

DESCRIPTIONS: dict[str, str] = {
    "working": "GPU working set (gathered layers, live activations, logits)",
    "pinned": "page-locked staging buffers",
    "gradients": "gradients",
    "master": "fp32 master weights",
    "optimizer": "Adam moments (exp_avg, exp_avg_sq)",
    "weights": "model weights",
    "checkpoints": "activation checkpoints",
}

# The CUDA context, cuBLAS workspaces and the allocator's slack on each GPU.
GPU_RUNTIME_OVERHEAD = 1 << 30
# Activation bytes per token per hidden unit for one layer in 16-bit with flash
# attention and no sequence parallelism (Korthikanti et al., 2022: 34·s·b·h).
ACTIVATION_FACTOR = 34
# memstrata streams optimizer state in sub-groups of one layer's slice of the flat
# fp32 partition, capped so one huge layer cannot pin tens of GiB.
SUB_GROUP_CAP = 1 << 27
PAGE = 4096


class JobShape(BaseModel):
    """Everything about a job that decides its bytes, independent of any node."""

    model_config = ConfigDict(frozen=True)
    model: ModelArchitecture
    sequence_length: int = Field(gt=0)
    micro_batch: int = Field(gt=0)
    precision: Precision = "bf16"
    gpus: int = Field(1, ge=0)
    engine: Engine = "deepspeed"

    @property
    def ranks(self) -> int:
        return max(self.gpus, 1)

    @property
    def weight_bytes(self) -> int:
        """Bytes per element of weights, gradients and activations."""
        return 4 if self.precision == "fp32" else 2


def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def working_set(job: JobShape) -> int:
    """Per-rank bytes that must sit next to the compute (HBM, or DRAM when training on the CPU).

    = 2 gathered layers (current + prefetched) of weights and their gradients
    + the largest tensor (embedding or LM head) gathered once
    + one layer's live activations: 34·s·b·h in 16-bit (x2 in fp32)
    + logits: s·b·vocab in 16-bit plus an fp32 copy for the loss
    + a fixed 1 GiB for the CUDA runtime when on a GPU.
    """
    m, w = job.model, job.weight_bytes
    tokens = job.sequence_length * job.micro_batch
    layers = 2 * m.layer_params() * w * 2
    largest = m.largest_tensor() * w
    activations = ACTIVATION_FACTOR * tokens * m.hidden * (w // 2)
    logits = tokens * m.vocab * (w + 4)
    runtime = GPU_RUNTIME_OVERHEAD if job.gpus else 0
    return layers + largest + activations + logits + runtime


def pinned_buffers(job: JobShape, optimizer_on_nvme: bool, params_on_nvme: bool) -> int:
    """Page-locked host staging for all ranks on the node.

    memstrata sizes its buffers from the model's shapes (exact size, 4 KiB aligned):
    per rank, parameters need two layers plus the largest tensor in flight, and
    streamed optimizer state two sub-groups of min(layer, 2^27) elements at 12 B
    each (fp32 master + 2 moments) — one being updated while the next is read.

    Stock DeepSpeed, run with the settings memstrata.runtime.train.dsconfig gives it, locks
    what memstrata.plan.stock.pinned_pool_bytes counts: buffer_count buffers of the
    largest tensor for parameters, four of the largest sub-group for optimizer state.
    """
    m, w = job.model, job.weight_bytes
    per_rank = 0
    if job.engine == "memstrata":
        if params_on_nvme:
            per_rank += _pages(2 * m.layer_params() * w) + _pages(m.largest_tensor() * w)
        if optimizer_on_nvme:
            per_rank += 2 * _pages(min(m.layer_params(), SUB_GROUP_CAP) * 12)
    else:
        per_rank = pinned_pool_bytes(m, w, params_on_nvme=params_on_nvme, optimizer_on_nvme=optimizer_on_nvme)
    return per_rank * job.ranks


def category_bytes(job: JobShape) -> dict[str, int]:
    """Node-wide bytes of the state that ZeRO-3 partitions across ranks (so it does not scale with GPUs).

    With P parameters in 16-bit training: weights 2P, gradients 2P, fp32 master 4P,
    Adam moments 8P. In fp32 training weights and gradients are 4P each, and the master is
    still 4P: ZeRO-3 keeps its own flat fp32 partitions (stage3 `_create_fp32_partitions`)
    beside the parameters in every precision. Activation checkpoints keep one hidden-state
    tensor per layer per rank: layers·s·b·h in the training precision.
    """
    p, m, w = job.model.parameters(), job.model, job.weight_bytes
    return {
        "weights": p * w,
        "gradients": p * w,
        "master": 4 * p,
        "optimizer": 8 * p,
        "checkpoints": m.layers * job.sequence_length * job.micro_batch * m.hidden * w * job.ranks,
    }
