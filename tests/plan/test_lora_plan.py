"""LoRA in the planner: the frozen base weights are placed like any weights (plus the adapters), but only the
adapters have gradients, fp32 master weights and Adam moments. Numbers computed by hand.

Llama-3-8B, r 16 on q_proj and v_proj: A = 32 x (16·(4096+4096) + 16·(4096+1024)) = 6,815,744 adapter elements.
Llama-3-70B, same settings: A = 80 x (16·(8192+8192) + 16·(8192+1024)) = 32,768,000.
"""
from __future__ import annotations

from typing import Any

import pytest

from memstrata.api.architecture import PRESETS, ModelArchitecture
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.inventory import NodeInventory, NumaNode, NvmeNamespace
from memstrata.api.lora import Lora, adapter_tensor_sizes
from memstrata.api.manifest import load_job, load_node
from memstrata.api.units import GiB
from memstrata.plan import JobShape, job_shape, plan_job
from memstrata.plan.accounting import category_bytes, subgroup_sizes
from memstrata.plan.table import render_plan


def _job(preset: str, lora: Lora | None, **kw: Any) -> JobShape:
    arch = PRESETS[preset]
    adapters = tuple(adapter_tensor_sizes(arch, lora)) if lora is not None else None
    return JobShape(model=arch, sequence_length=4096, micro_batch=1, gpus=1, adapter_tensors=adapters, **kw)


def test_llama3_8b_lora_state_is_the_adapters_only() -> None:
    full, lora = category_bytes(_job("llama3-8b", None)), category_bytes(_job("llama3-8b", Lora()))
    assert lora["weights"] == 16_074_153_984        # (8,030,261,248 + 6,815,744) x 2 B: the base stays, frozen
    assert lora["gradients"] == 13_631_488          # 6,815,744 x 2 B
    assert lora["master"] == 27_262_976             # x 4 B
    assert lora["optimizer"] == 54_525_952          # x 8 B
    assert full["master"] + full["optimizer"] == 96_363_134_976
    # 1,178x less optimizer state; the weights grow by the adapters' 0.08 %.
    assert (full["master"] + full["optimizer"]) // (lora["master"] + lora["optimizer"]) == 1178
    assert lora["checkpoints"] == full["checkpoints"]


def test_subgroups_are_cut_from_the_adapters_as_zero3_cuts_the_trainable_tensors() -> None:
    # The unit is min(layer 218,112,000, 2^27, 8,030,261,248 // 16) = 134,217,728 elements: every adapter fits in
    # one sub-group, the only one the optimizer has.
    assert subgroup_sizes(_job("llama3-8b", Lora(), engine="memstrata")) == [6_815_744]
    assert len(subgroup_sizes(_job("llama3-8b", None, engine="memstrata"))) > 32


def _spec(method: str) -> FineTuneJobSpec:
    return FineTuneJobSpec.model_validate({
        "model": {"preset": "llama3-70b"}, "dataset": {"synthetic": "copy"},
        "training": {"steps": 10, "sequenceLength": 8192, "method": method}, "memory": {"nvmeNamespaces": 2}})


def test_70b_lora_keeps_every_byte_of_optimizer_state_in_dram(repo) -> None:
    node = load_node(repo / "examples/node-cxl.yaml")
    full, lora = plan_job(_spec("full"), node), plan_job(_spec("lora"), node)
    assert full.feasible and lora.feasible, (full.verdict(), lora.verdict())
    # A full fine-tune spills the moments and master weights to NVMe and pins buffers to stream them ...
    assert full.category("optimizer").on("nvme") > 0 and full.category("pinned").bytes > 0
    # ... LoRA's 32,768,000 adapter elements need 32,768,000 x (4 + 8) B = 393,216,000 B, all in DRAM.
    assert lora.trainable_parameters == 32_768_000 and full.trainable_parameters is None
    assert lora.category("master").on("dram") == 131_072_000
    assert lora.category("optimizer").on("dram") == 262_144_000
    assert lora.category("gradients").on("dram") == 65_536_000
    assert lora.bytes_on("nvme") == 0 and lora.update_io_seconds == 0
    # Nothing is staged: the only locked buffer is the update's widened fp32 gradient of the adapters' sub-group.
    assert lora.category("pinned").bytes == 4 * 32_768_000
    # The frozen base weights are placed like a full fine-tune's (on CXL here), with the adapters beside them.
    weights = lora.category("weights")
    assert weights.on("cxl") == weights.bytes == (70_553_706_496 + 32_768_000) * 2
    assert "trainable: 32,768,000 (LoRA adapters)" in render_plan(lora, "70b lora")


@pytest.mark.parametrize("method", ["full", "lora"])
def test_job_shape_carries_the_adapters_only_for_lora(method: str) -> None:
    shape = job_shape(_spec(method))
    assert (shape.adapter_tensors is not None) == (method == "lora")


SMOLLM2 = ModelArchitecture(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, vocab=49152, tied=True,
                            max_positions=8192)


def test_the_chat_demo_as_lora_keeps_its_state_in_the_budget_the_full_demo_spills(repo) -> None:
    node = NodeInventory(numa_nodes=[NumaNode(id=0, cpus=[0, 1], memory_bytes=24 * GiB)],
                         nvme_namespaces=[NvmeNamespace(name="nvme0n1", size_bytes=100 * GiB, free=True)])
    plans = {}
    for name in ("finetune-chat.yaml", "finetune-chat-lora.yaml"):
        spec = load_job(repo / "examples" / name).spec.with_architecture(SMOLLM2)  # as read from config.json
        plans[name] = plan_job(spec, node)
    full, lora = plans["finetune-chat.yaml"], plans["finetune-chat-lora.yaml"]
    # r 16 on all seven linear modules: 30 x 16 x ((576+576) x 2 + (576+192) x 2 + (576+1536) x 3) = 4,884,480.
    assert lora.trainable_parameters == 4_884_480
    assert full.bytes_on("nvme") > GiB and lora.bytes_on("nvme") == 0
