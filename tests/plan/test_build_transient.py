"""Building the model costs host memory for a moment: under zero.Init one layer's 16-bit parameters exist
before they are partitioned, and the weights streamed from safetensors pass through the host one tensor at
a time, counted in fp32. The plan reserves it in DRAM, never on CXL or NVMe. Numbers computed by hand.

Llama-3-8B: one layer 218,112,000 params, largest tensor (embedding / LM head) 128256·4096 = 525,336,576.
  bf16: 218,112,000·2 + 525,336,576·4 = 436,224,000 + 2,101,346,304 = 2,537,570,304 B (2.36 GiB)
  fp32: 218,112,000·4 + 525,336,576·4 = 872,448,000 + 2,101,346,304 = 2,973,794,304 B
"""
from __future__ import annotations

import re
from pathlib import Path

from memstrata.api import load_job
from memstrata.api.architecture import PRESETS
from memstrata.api.finetunejob import MemoryPolicy
from memstrata.api.inventory import CxlNode, Gpu, NodeInventory, NumaNode, NvmeNamespace
from memstrata.api.manifest import load_node
from memstrata.api.units import GiB
from memstrata.plan import JobShape, build_transient, plan_for_node, plan_job
from memstrata.plan.table import render_plan

LLAMA = PRESETS["llama3-8b"]


def _node(dram: int, cxl: int = 0) -> NodeInventory:
    return NodeInventory(
        numa_nodes=[NumaNode(id=0, cpus=[0, 1], memory_bytes=dram)],
        cxl_nodes=[CxlNode(numa_node=1, memory_bytes=cxl)] if cxl else [],
        nvme_namespaces=[NvmeNamespace(name="nvme0n1", size_bytes=1 << 40, free=True)],
        gpus=[Gpu(index=i, hbm_bytes=80 * GiB) for i in range(2)],
    )


def _shape(**changes: object) -> JobShape:
    base: dict[str, object] = dict(model=LLAMA, sequence_length=4096, micro_batch=1, gpus=1, engine="memstrata")
    return JobShape(**{**base, **changes})


def test_build_transient_llama3_8b() -> None:
    assert build_transient(_shape()) == 2_537_570_304
    assert build_transient(_shape(precision="fp32")) == 2_973_794_304
    assert build_transient(_shape(gpus=2)) == 2 * 2_537_570_304   # every rank reads the checkpoint itself


def test_build_transient_scales_with_the_largest_tensor() -> None:
    # Doubling the vocabulary doubles the embedding (the largest tensor) and leaves a layer as it was:
    # the transient grows by 128256·4096·4 = 2,101,346,304 B, all of it in DRAM.
    wide = LLAMA.model_copy(update={"vocab": 2 * LLAMA.vocab})
    assert wide.layer_params() == LLAMA.layer_params()
    policy = MemoryPolicy(engine="memstrata")
    narrow_plan = plan_for_node(_shape(), _node(512 * GiB), policy)
    wide_plan = plan_for_node(_shape(model=wide), _node(512 * GiB), policy)
    assert narrow_plan.category("build").on("dram") == 2_537_570_304
    assert wide_plan.category("build").on("dram") - narrow_plan.category("build").on("dram") == 2_101_346_304


def test_build_transient_lands_in_dram_even_with_cxl_and_nvme_free() -> None:
    plan = plan_for_node(_shape(), _node(512 * GiB, cxl=256 * GiB), MemoryPolicy(engine="memstrata"))
    assert plan.feasible, plan.verdict()
    build = plan.category("build")
    assert build.bytes == 2_537_570_304
    assert [a.stratum for a in build.placement] == ["dram"]


def test_too_little_dram_for_the_build_is_a_shortfall_not_a_spill() -> None:
    """2 GiB of DRAM (2,147,483,648 B, no reserve) against a 2,537,570,304 B build: short 390,086,656,
    although 256 GiB of CXL and 1 TiB of NVMe are free."""
    plan = plan_for_node(_shape(), _node(2 * GiB, cxl=256 * GiB),
                         MemoryPolicy(engine="memstrata", dram_reserve_fraction=0))
    assert not plan.feasible
    missing = {(s.stratum, s.category): s.missing_bytes for s in plan.shortfalls}
    assert missing[("dram", "build")] == 390_086_656
    assert "building the model needs 2.4 GiB" in plan.verdict()
    assert plan.category("build").on("cxl") == plan.category("build").on("nvme") == 0


def test_dram_budget_bounds_offloaded_state_not_the_build() -> None:
    """memory.dramBudget caps what offloaded state may use; the build transient is claimed before it,
    like the working set, so a 20 GiB budget still leaves 20 GiB for gradients and optimizer state."""
    budget = 20 * GiB
    plan = plan_for_node(_shape(), _node(512 * GiB), MemoryPolicy(engine="memstrata", dram_budget=budget))
    offloaded = plan.bytes_on("dram") - plan.category("build").on("dram")
    assert plan.category("build").on("dram") == 2_537_570_304
    assert offloaded == budget   # filled to the byte: what does not fit spills to NVMe
    assert plan.bytes_on("nvme") > 0


def test_example_plan_shows_the_build_row(repo: Path) -> None:
    plan = plan_job(load_job(repo / "examples/finetune.yaml").spec, load_node(repo / "examples/node-cxl.yaml"))
    assert plan.feasible, plan.verdict()
    row = next(line for line in render_plan(plan, "t").splitlines() if line.startswith("model build"))
    # label, bytes, HBM, DRAM, CXL, NVMe
    assert re.split(r"\s{2,}", row.strip())[1:] == ["2.4 GiB", "-", "2.4 GiB", "-", "-"]
