"""How many bytes each category of a fine-tuning job needs. Pure arithmetic, no I/O.

Every formula here is stated in the docstring of the function that computes it,
so a reader can check a number in `memstrata plan` by hand.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.finetunejob import Precision
from memstrata.api.strataplan import Engine
from memstrata.plan.stock import DS_ALIGN_ELEMENTS

Category = Literal["working", "pinned", "build", "gradients", "master", "optimizer", "weights", "checkpoints"]

DESCRIPTIONS: dict[str, str] = {
    "working": "GPU working set (gathered layers, live activations, logits)",
    "pinned": "page-locked staging buffers",
    "build": "model build (one layer, largest tensor in fp32)",
    "gradients": "gradients",
    "master": "fp32 master weights",
    "optimizer": "Adam moments (exp_avg, exp_avg_sq)",
    "weights": "model weights",
    "checkpoints": "activation checkpoints",
}
CPU_WORKING_SET = "CPU working set (gathered layers, live activations, logits)"  # "working" of a job with no GPU

# The CUDA context, cuBLAS workspaces and the allocator's slack on each GPU.
GPU_RUNTIME_OVERHEAD = 1 << 30
# DRAM of one rank process that the plan does not count, because it is not the job's tensors: the interpreter
# with torch, DeepSpeed and transformers imported (0.52 GiB with torch and DeepSpeed; 0.71 GiB with transformers and
# PEFT too), their allocator arenas, the swap layer's locked pool growing in whole chunks, and on a GPU the CUDA
# runtime's host side (about 1 GiB more). Measured on the CPU: the tiny example peaks at 0.83 GiB RSS for a 17 MiB
# plan, a LoRA job of SmolLM2-135M at 2.7 GiB for a 1.2 GiB plan. A job's pod asks for it on top of the plan.
RUNTIME_PROCESS_BYTES = 2 << 30
RUNTIME_NOTE = "not counted above"
# DeepSpeed's default reduce_bucket_size (elements).
DS_REDUCE_BUCKET_ELEMENTS = 500_000_000
# memstrata streams optimizer state in sub-groups of one layer's slice of the flat
# fp32 partition, capped so one huge layer cannot pin tens of GiB.
SUB_GROUP_CAP = 1 << 27
PAGE = 4096
# The fewest optimizer sub-groups memstrata's engine cuts a model into (small models have few layers).
MIN_SUBGROUPS = 16
# What one element of optimizer state costs in DRAM: fp32 master weights and the two Adam moments.
STATE_BYTES_PER_ELEMENT = 12
# A slice of a sliced sub-group starts on a 4 KiB block of its 16-bit partition (and so of its fp32 state), and is a
# whole multiple of every SIMD width of DeepSpeedCPUAdam, so slicing moves no element between its vector loop and
# its scalar tail.
SLICE_ALIGN_ELEMENTS = 2048
# Streamed sub-groups kept in DRAM from one update to the next (MLP-Offload's cache): what a plan gives the runtime.
CACHED_SUBGROUPS = 1
# memstrata's swapper leaves smaller tensors in DRAM (DeepSpeed's own floor is 1 MiB); the swap layer's default.
MIN_SWAP_BYTES = 64 << 10


class JobShape(BaseModel):
    """Everything about a job that decides its bytes, independent of any node."""

    model_config = ConfigDict(frozen=True)
    model: ModelArchitecture
    sequence_length: int = Field(gt=0)
    micro_batch: int = Field(gt=0)
    precision: Precision = "bf16"
    gpus: int = Field(1, ge=0)
    # spec.resources: ZeRO-3 partitions the model state over all nodes x ranks; None: one rank per GPU, or
    # one on the CPU (what memstrata.api.finetunejob.Resources.ranks() says, passed in by job_shape).
    nodes: int = Field(1, ge=1)
    ranks_per_node: int | None = Field(None, ge=1)
    gradient_accumulation: int = Field(1, gt=0)
    engine: Engine = "deepspeed"
    # spec.training.activationCheckpointing: the runtime turns on Hugging Face gradient checkpointing
    # exactly when this is true, so the working set below must follow it or a "fits" is false.
    activation_checkpointing: bool = True
    # spec.training.lossChunkTokens: the logits exist this many tokens at a time (0: whole).
    loss_chunk_tokens: int = Field(0, ge=0)
    # spec.training.method lora: the adapter tensors' elements in parameter order (memstrata.api.lora.
    # adapter_tensor_sizes), the only ones that train; None: a full fine-tune, where every tensor trains.
    adapter_tensors: tuple[int, ...] | None = None
    # Of those, the elements of base tensors that train whole (training.lora.modulesToSave): weights the model has
    # anyway, not extra ones.
    saved_elements: int = Field(0, ge=0)
    # memstrata's sub-group unit when the planner chose one below the model's (`subgroup_unit`): a tight DRAM
    # budget streams smaller sub-groups and slices through smaller buffers. None: the model's own.
    sub_group_elements: int | None = Field(None, ge=SLICE_ALIGN_ELEMENTS)
    # spec.training.layerMajor: every micro-batch of a step through a layer before the next one (memstrata.api.
    # layermajor); None: the planner decides (on where weights go to NVMe). The byte counts below read it as on
    # only when it is True, so a resolved shape is what they count.
    layer_major: bool | None = None
    # spec.training.update delayed (memstrata's engine): the update writes new 16-bit weights into shadows while the
    # backward still reads the old ones, at most every trained weight once more.
    delayed_update: bool = False

    @model_validator(mode="after")
    def _one_rank_per_gpu(self) -> "JobShape":
        if self.gpus and self.ranks_per_node is not None and self.ranks_per_node != self.gpus:
            raise ValueError(f"ranks_per_node {self.ranks_per_node} != gpus {self.gpus}: one rank per GPU")
        return self

    @property
    def ranks(self) -> int:
        """Training processes on one node: everything per rank is counted this many times in a node's plan."""
        return self.ranks_per_node or max(self.gpus, 1)

    @property
    def world_size(self) -> int:
        """Training processes of the whole job: ZeRO-3 partitions the model state over all of them."""
        return self.nodes * self.ranks

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over the whole job: microBatch and gradientAccumulation are per rank."""
        return self.micro_batch * self.gradient_accumulation * self.world_size

    @property
    def waves(self) -> int:
        """Micro-batches whose activation checkpoints live at once: gradientAccumulation run layer-major, else 1."""
        return self.gradient_accumulation if self.layer_major else 1

    @property
    def weight_bytes(self) -> int:
        """Bytes per element of weights, gradients and activations."""
        return 4 if self.precision == "fp32" else 2


def pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def working_set(job: JobShape) -> int:
    """Per-rank bytes that must sit next to the compute (HBM, or DRAM when training on the CPU).

    = 2 gathered layers (current + prefetched) of weights and their gradients
    + the largest tensor (embedding or LM head) gathered once
    + live activations, `activation_bytes`: the tensors autograd saves, counted from the layer's shapes
    + logits: s·b·vocab elements, each 2w + 8 B at the peak in backward (the 16-bit logits, their fp32 copy,
      the fp32 gradient of the loss and its cast into the head; measured: 11.9 B in bf16), or only
      lossChunkTokens of them when the loss is chunked (each chunk's logits are recomputed in backward)
    + on the stock engine, the activation checkpoints: Hugging Face keeps them on the compute device, where
      memstrata's engine moves them to the `checkpoints` category's stratum
    + layer-major (`job.waves` micro-batches a step through each layer together), the hidden states of all of
      them around the layer being run: its stacked input, the micro-batches' outputs and their concatenation in
      forward (in backward the output's gradient, the inputs' gradients and theirs), 3·waves·s·b·h·w
    + ZeRO-3's gradient reduce bucket: `reduce_bucket_elements` 16-bit gradients, allocated whole at start
      (DeepSpeed's default 5e8 elements is 0.93 GiB of bf16, whatever the model's size)
    + a fixed 1 GiB for the CUDA runtime when on a GPU.

    Llama-3-8B at s = 32768, b = 1, bf16: one layer saves 201,352 B a token (`layer_activation_bytes`),
    A = 6,597,902,336 B (6.14 GiB) a layer, so the activations are 2·A + 32768·32,768 (the head's input)
    = 14,269,546,496 B (13.3 GiB) with checkpointing and 33·A + the same = 218,804,518,912 B (204 GiB) without.
    """
    m, w = job.model, job.weight_bytes
    tokens = job.sequence_length * job.micro_batch
    layers = 2 * m.layer_params() * w * 2
    largest = m.largest_tensor() * w
    logit_tokens = min(tokens, job.loss_chunk_tokens) if job.loss_chunk_tokens else tokens
    logits = logit_tokens * m.vocab * (2 * w + 8)
    on_device = 0 if job.engine == "memstrata" else checkpoint_bytes(job) // job.ranks
    stacked = 3 * job.waves * tokens * m.hidden * w if job.waves > 1 else 0
    bucket = reduce_bucket_elements(m) * w
    runtime = GPU_RUNTIME_OVERHEAD if job.gpus else 0
    return layers + largest + activation_bytes(job) + logits + on_device + stacked + bucket + runtime


def activation_bytes(job: JobShape) -> int:
    """Per-rank bytes of activations live at the peak: every layer's saved tensors from forward to backward
    without checkpointing (with it, the one layer being recomputed), one layer's more for the gradients flowing
    back through a layer in backward, and what the final norm and the LM head keep of the last hidden state
    (`head_input_bytes`). Exact for the runtime's sdpa attention: it keeps no s x s score matrix."""
    m, w = job.model, job.weight_bytes
    tokens = job.sequence_length * job.micro_batch
    # Layer-major, the final norm and the head run once over every micro-batch of the step.
    return tokens * ((activation_layers(job) + 1) * layer_activation_bytes(m, w) + job.waves * head_input_bytes(m, w))


def layer_activation_bytes(m: ModelArchitecture, w: int) -> int:
    """Bytes one transformer layer saves for backward per token, in the training precision of w bytes, as
    transformers' layers with sdpa attention save them: its family's formula (memstrata.api.families; llama:
    8h + 8 + 6hw + 2·kv·w + 4n + 2(h/n)w + 4iw, gpt: 8hw + 4w + 4n + 5iw), measured with torch's saved-tensor
    hooks on transformers 5.23."""
    return m.spec.layer_activation_bytes(m, w)


def head_input_bytes(m: ModelArchitecture, w: int) -> int:
    """Bytes per token the final norm and the LM head keep of the last hidden state, by the family: Llama's
    RMSNorm its fp32 input and normalized output, the head its input ((4 + 2w)·h); GPT's LayerNorm its input
    and output (2hw)."""
    return m.spec.head_input_bytes(m, w)


def reduce_bucket_elements(m: ModelArchitecture) -> int:
    """ZeRO-3's `reduce_bucket_size`, which memstrata.runtime.train.dsconfig sets for both engines: one layer's
    gradients (a larger tensor, the embedding, is reduced outside the bucket, as DeepSpeed does with any tensor
    that does not fit), never more than DeepSpeed's own 5e8. The bucket is allocated whole on the compute device
    when the engine is built."""
    return min(DS_REDUCE_BUCKET_ELEMENTS, -(-m.layer_params() // DS_ALIGN_ELEMENTS) * DS_ALIGN_ELEMENTS)


def checkpoint_bytes(job: JobShape) -> int:
    """One hidden state per layer per rank of the node (layers·s·b·h in the training precision, x ranks), and
    layer-major x gradientAccumulation (every micro-batch of the step is between forward and backward at once):
    what activation checkpointing keeps from forward to backward; 0 without checkpointing."""
    m = job.model
    kept = m.layers * job.waves if job.activation_checkpointing else 0
    return kept * job.sequence_length * job.micro_batch * m.hidden * job.weight_bytes * job.ranks


def activation_layers(job: JobShape) -> int:
    """Layers whose activations are live on the compute device at once: 1 when checkpointing recomputes
    them one layer at a time in backward, all of them otherwise."""
    return 1 if job.activation_checkpointing else job.model.layers


def build_transient(job: JobShape) -> int:
    """Host bytes that building the model costs on top of its placed state, for all ranks on the node.

    The runtime builds the model under DeepSpeed's zero.Init, which partitions each module's parameters
    as soon as it is constructed, then streams the checkpoint in from safetensors one module's tensors
    at a time (memstrata.runtime.train.model.hfmodel.load_weights). So each rank holds at most, transiently,
    one layer's 16-bit parameters (the module being built or loaded) plus the largest tensor read from
    the shard and converted, counted in fp32 since a checkpoint may be stored in fp32:
        per rank = layer_params · weight_bytes + largest_tensor · 4.
    Every rank runs the load loop itself (only rank 0's copy is kept, but each reads), hence x ranks.
    It is reserved beside the steady state rather than overlapped with state built later (the fp32
    master and moments): a few GiB of slack buys a plan that holds whatever order the runtime uses.
    Llama-3-8B, bf16, one GPU: 218,112,000·2 + 525,336,576·4 = 2,537,570,304 B (2.36 GiB).
    """
    m = job.model
    return (m.layer_params() * job.weight_bytes + m.largest_tensor() * 4) * job.ranks


def memstrata_subgroup_elements(arch: ModelArchitecture) -> int:
    """memstrata's engine's ZeRO-3 sub_group_size, grouped by `group_tensors`: about one transformer layer, but
    small enough for MIN_SUBGROUPS sub-groups (the steps a DRAM budget is spent in, and the size of the buffers
    the streamed ones need), capped at 2^27 elements, and at least the smallest tensor its swapper swaps
    (MIN_SWAP_BYTES of fp32)."""
    unit = min(arch.layer_params(), SUB_GROUP_CAP, arch.parameters() // MIN_SUBGROUPS)
    return max(unit, MIN_SWAP_BYTES // 4)


def slice_elements(unit: int) -> int:
    """Elements of one slice of a sub-group updated a slice at a time (memstrata.runtime.swap.sliced): the sub-group
    unit rounded down to whole SLICE_ALIGN_ELEMENTS, so a slice's buffers are never larger than a streamed
    sub-group's."""
    return max(SLICE_ALIGN_ELEMENTS, unit // SLICE_ALIGN_ELEMENTS * SLICE_ALIGN_ELEMENTS)


def subgroup_unit(job: JobShape) -> int:
    """The sub-group unit memstrata's engine runs `job` with: the planner's choice, else the model's own
    (`memstrata_subgroup_elements`)."""
    return job.sub_group_elements or memstrata_subgroup_elements(job.model)


def group_tensors(sizes: Sequence[int], unit: int) -> list[list[int]]:
    """memstrata's rule for cutting one rank's parameter partitions (`sizes`, in order) into optimizer sub-groups:
    a partition of at least `unit` elements closes the open sub-group and forms one of its own; smaller ones
    accumulate until the open sub-group reaches `unit`. So the big tensors (the embedding, the LM head) are alone
    and every other sub-group is under 2 x unit. Indices into `sizes`, per sub-group. The runtime groups ZeRO-3's
    partitions with it (memstrata.runtime.swap.resident) and the planner the architecture's tensors."""
    groups: list[list[int]] = []
    open_group: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if n >= unit:
            if open_group:
                groups.append(open_group)
                open_group, total = [], 0
            groups.append([i])
            continue
        open_group.append(i)
        total += n
        if total >= unit:
            groups.append(open_group)
            open_group, total = [], 0
    if open_group:
        groups.append(open_group)
    return groups


def subgroup_sizes(job: JobShape) -> list[int]:
    """One rank's optimizer sub-groups in elements, as memstrata's engine forms them: `group_tensors` over each
    tensor's per-rank partition."""
    parts = rank_partitions(job)
    return [sum(parts[i] for i in g) for g in group_tensors(parts, subgroup_unit(job))]


def rank_partitions(job: JobShape) -> list[int]:
    """Each trained tensor's per-rank partition, in order: ZeRO-3 gives each rank ceil(n / world) of every tensor,
    and builds optimizer sub-groups from the trained ones only (with LoRA, the adapters)."""
    return [-(-n // job.world_size) for n in trained_tensor_sizes(job)]


def trained_tensor_sizes(job: JobShape) -> list[int]:
    """Elements of every tensor that trains, in parameter order: all of the model's, or LoRA's adapters."""
    return list(job.adapter_tensors) if job.adapter_tensors is not None else job.model.tensor_sizes()


def trained_parameters(job: JobShape) -> int:
    """Elements that train (have gradients, fp32 master weights and Adam moments)."""
    return sum(job.adapter_tensors) if job.adapter_tensors is not None else job.model.parameters()


def choose_resident(sizes: Sequence[int], budget_bytes: int | None,
                    eligible: Sequence[bool] | None = None) -> set[int]:
    """Sub-groups (indices into `sizes`, in elements) kept in DRAM for good: largest first (ties by index) while
    their state, STATE_BYTES_PER_ELEMENT each, fits in `budget_bytes` (None: none), so the ones that stream are
    the small ones and their buffers small. Only `eligible` ones are considered (the others stay in DRAM
    anyway). The one rule of the runtime's choice and of the planner's buffer sizing."""
    if not budget_bytes:
        return set()
    left, kept = budget_bytes, set()
    for i in sorted(range(len(sizes)), key=lambda g: (-sizes[g], g)):
        need = sizes[i] * STATE_BYTES_PER_ELEMENT
        if (eligible is None or eligible[i]) and need <= left:
            kept.add(i)
            left -= need
    return kept


PARTITIONED = ("weights", "gradients", "master", "optimizer")


def partition(total: int, job: JobShape) -> int:
    """One node's share of state that ZeRO-3 partitions over the whole job: each of the world_size ranks
    holds ceil(total / world_size) bytes (rounded up per rank, as ZeRO-3 pads its flat partitions), and a
    node holds ranks of them. So 2 nodes x 1 rank need half of it per node; 1 node x 2 ranks all of it."""
    return -(-total // job.world_size) * job.ranks


def category_bytes(job: JobShape) -> dict[str, int]:
    """Bytes on one node of the model state: what ZeRO-3 partitions over all ranks of the job, and the
    activation checkpoints each rank of the node keeps for itself.

    With P parameters in 16-bit training, for the whole job: weights 2P, gradients 2P, fp32 master 4P,
    Adam moments 8P. In fp32 training weights and gradients are 4P each, and the master is
    still 4P: ZeRO-3 keeps its own flat fp32 partitions (stage3 `_create_fp32_partitions`)
    beside the parameters in every precision. A node holds `partition` of each: x ranks / world_size.
    With LoRA only the A adapter elements train: weights (P + A)·w, gradients A·w, master 4A, moments 8A; the
    frozen base weights have no gradient and no optimizer state (ZeRO-3 builds both for trainable tensors only).
    Base tensors LoRA trains whole (modulesToSave, S elements) count as trained but not as extra weights:
    weights (P + A)·w, gradients (A + S)·w, master 4(A + S), moments 8(A + S).
    The delayed update (memstrata.api.updatemode) adds the 16-bit shadows of the trained weights, t·w, to the
    weights: they live where the weights do, as long as the backward still reads the old ones.
    Activation checkpoints (`checkpoint_bytes`) are a category of their own only on memstrata's engine,
    which offloads them to the host (memstrata.runtime.swap.activations); stock DeepSpeed keeps them
    beside the compute, in `working_set`.
    """
    p, w, t = job.model.parameters(), job.weight_bytes, trained_parameters(job)
    # LoRA's A and B are weights beside the frozen base (a module it saves whole is a base weight already).
    adapters = t - job.saved_elements if job.adapter_tensors is not None else 0
    shadows = t * w if job.delayed_update and job.engine == "memstrata" else 0
    whole = {"weights": (p + adapters) * w + shadows, "gradients": t * w, "master": 4 * t, "optimizer": 8 * t}
    return {
        **{name: partition(total, job) for name, total in whole.items()},
        "checkpoints": checkpoint_bytes(job) if job.engine == "memstrata" else 0,
    }
