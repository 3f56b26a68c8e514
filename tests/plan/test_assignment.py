"""The placement rule of the CXL study, and refusals that say what is missing, where, and how much."""
from __future__ import annotations

import subprocess
import sys

import pytest

from memstrata.api.architecture import PRESETS
from memstrata.api.finetunejob import MemoryPolicy
from memstrata.api.manifest import load_node
from memstrata.api.inventory import CxlNode, Gpu, NodeInventory, NumaNode, NvmeNamespace
from memstrata.api.units import GiB
from memstrata.api.strataplan import Plan
from memstrata.plan import JobShape, plan_for_node

OPTIMIZER_OPERANDS = ("gradients", "master", "optimizer")


@pytest.fixture
def cxl_node(repo) -> NodeInventory:
    return load_node(repo / "examples/node-cxl.yaml")


def test_8b_32k_keeps_optimizer_in_dram_and_dma_data_on_cxl(cxl_node: NodeInventory) -> None:
    job = JobShape(model=PRESETS["llama3-8b"], sequence_length=32768, micro_batch=1, gpus=1, engine="memstrata")
    plan = plan_for_node(job, cxl_node, MemoryPolicy(engine="memstrata", nvme_namespaces=2))
    assert plan.feasible, plan.verdict()
    for name in OPTIMIZER_OPERANDS:
        assert plan.category(name).on("dram") == plan.category(name).bytes
    assert plan.category("checkpoints").on("cxl") == 8_589_934_592
    assert plan.category("weights").on("cxl") == 16_060_522_496
    assert plan.bytes_on("nvme") == 0
    # ceil((8,589,934,592 + 16,060,522,496) / 2^30) = ceil(22.96) = 23
    assert plan.requests == {"nvidia.com/gpu": 1, "memstrata.dev/cxl-gib": 23}
    assert plan.cxl_nodes == [1]


def test_70b_spills_optimizer_state_to_nvme_never_to_cxl(cxl_node: NodeInventory) -> None:
    job = JobShape(model=PRESETS["llama3-70b"], sequence_length=8192, micro_batch=1, gpus=1, engine="memstrata")
    plan = plan_for_node(job, cxl_node, MemoryPolicy(engine="memstrata", nvme_namespaces=2))
    assert plan.feasible, plan.verdict()
    for name in OPTIMIZER_OPERANDS:
        assert plan.category(name).on("cxl") == 0
    assert plan.category("optimizer").on("nvme") > 0
    assert plan.category("gradients").on("dram") == plan.category("gradients").bytes
    assert plan.nvme_namespaces == ["nvme0n1", "nvme1n1"]
    assert plan.requests["memstrata.dev/nvme-ns"] == 2
    assert plan.category("pinned").bytes > 0          # streaming state needs staging buffers
    assert plan.update_io_seconds > 0


def _small_node(dram: int, *, gpus: int = 1, cxl: int = 0, nvme: list[int] = ()) -> NodeInventory:
    return NodeInventory(
        numa_nodes=[NumaNode(id=0, cpus=[0, 1], memory_bytes=dram)],
        cxl_nodes=[CxlNode(numa_node=1, memory_bytes=cxl)] if cxl else [],
        nvme_namespaces=[NvmeNamespace(name=f"nvme{i}n1", size_bytes=s, free=True) for i, s in enumerate(nvme)],
        gpus=[Gpu(index=i, hbm_bytes=80 * GiB) for i in range(gpus)],
    )


def test_impossible_job_names_each_shortfall_in_bytes() -> None:
    """8B, bf16, seq 4096, 100 GiB DRAM (107,374,182,400 B, no reserve), no CXL, no NVMe, memstrata's engine
    (weights claim DRAM before the optimizer state): model build 218,112,000*2 + 525,336,576*4 = 2,537,570,304
    -> 104,836,612,096 left; the update's buffers, one resident sub-group's fp32 gradient at a time (the largest
    of several tensors, 159,391,744 elements; the embedding's a 134,217,728-element slice at a time):
    637,566,976 -> 104,199,045,120; gradients 16,060,522,496 -> 88,138,522,624 left; checkpoints 32*4096*4096*2 =
    1,073,741,824 -> 87,064,780,800; weights 16,060,522,496 -> 71,004,258,304; master 32,121,044,992 ->
    38,883,213,312 left; moments need 64,242,089,984: short 25,358,876,672."""
    job = JobShape(model=PRESETS["llama3-8b"], sequence_length=4096, micro_batch=1, gpus=1, engine="memstrata")
    plan = plan_for_node(job, _small_node(100 * GiB),
                         MemoryPolicy(engine="memstrata", nvme_namespaces=0, dram_reserve_fraction=0))
    assert not plan.feasible
    missing = {(s.category, s.stratum): s.missing_bytes for s in plan.shortfalls}
    assert missing == {("optimizer", "nvme"): 25_358_876_672}
    assert plan.category("pinned").bytes == 4 * 159_391_744
    assert "DRAM or NVMe: short by 23.6 GiB for Adam moments" in plan.verdict()


def test_hbm_too_small_for_working_set_says_what_to_change() -> None:
    node = _small_node(512 * GiB)
    node.gpus = [Gpu(hbm_bytes=24 * GiB)]
    job = JobShape(model=PRESETS["llama3-8b"], sequence_length=32768, micro_batch=1, gpus=1)
    plan = plan_for_node(job, node, MemoryPolicy(nvme_namespaces=0))
    assert not plan.feasible
    assert plan.shortfalls[0].stratum == "hbm"
    assert "lower training.sequenceLength" in plan.verdict()


@pytest.mark.parametrize("policy,node,expect", [
    (MemoryPolicy(require_cxl=True, nvme_namespaces=0), _small_node(512 * GiB), "requireCxl is set"),
    (MemoryPolicy(nvme_namespaces=3), _small_node(512 * GiB, nvme=[GiB << 10] * 2), "wants 3 free namespaces, node has 2"),
    (MemoryPolicy(nvme_namespaces=0), _small_node(512 * GiB, gpus=0), "GPUs: needs 1, node has 0"),
    (MemoryPolicy(nvme_namespaces=1, pinned_memory_cap=GiB, dram_budget=40 * GiB),
     _small_node(512 * GiB, nvme=[4 << 40]), "memory.pinnedMemoryCap allows 1.0 GiB"),
])
def test_constraints_refuse_with_a_named_reason(policy, node, expect) -> None:
    job = JobShape(model=PRESETS["llama3-8b"], sequence_length=2048, micro_batch=1, gpus=1)
    plan = plan_for_node(job, node, policy)
    assert not plan.feasible
    assert expect in plan.verdict()


def test_stock_deepspeed_gets_all_or_nothing_offload_and_no_cxl(cxl_node: NodeInventory) -> None:
    job = JobShape(model=PRESETS["llama3-70b"], sequence_length=8192, micro_batch=1, gpus=1, engine="deepspeed")
    plan = plan_for_node(job, cxl_node, MemoryPolicy(engine="deepspeed", nvme_namespaces=2))
    assert plan.bytes_on("cxl") == 0
    for name in ("master", "optimizer"):
        assert plan.category(name).on("nvme") == plan.category(name).bytes
    assert plan.offload_device("master", "optimizer") == "nvme"


def test_dram_budget_spills_to_nvme() -> None:
    """gpt-125m on the CPU under a 1.25 GiB budget (1,342,177,280 B). memstrata: the weights fit in DRAM, so only
    the optimizer state streams, the embedding's 38,633,472-element sub-group a slice at a time: the update's
    buffers are 346,398,720 (memstrata.plan.buffers.update_buffer_bytes; no tensor's size in it) ->
    995,778,560 left; gradients 250,524,672, checkpoints 9,437,184 (12*512*768*2), weights 250,524,672 ->
    485,292,032 left for the 1,503,148,032 B of master + moments, split as a sub-group holds them (4 of 12 bytes
    master): master 161,764,010 and moments 323,528,022 in DRAM, the rest on NVMe.
    At 1 GiB the weights still stay in DRAM (a byte of weights saves more I/O than a byte of state); the embedding's
    state no longer fits resident, so it streams in slices (7,086,080 elements) beside the sub-group the walk keeps
    cached (a layer, 7,088,128): 44 x 7,086,080 + 12 x 7,088,128 = 396,845,056 of buffers, and 166,410,240 B of
    state in DRAM. At 0.75 GiB the weights spill too, and their staging buffers join the pinned ones (2 layers + the
    largest tensor = 105,619,456). Stock's pinned pools alone exceed 1 GiB."""
    shape = dict(model=PRESETS["gpt-125m"], sequence_length=512, micro_batch=1, gpus=0)
    node = _small_node(64 * GiB, gpus=0, nvme=[100 * GiB])
    roomy = plan_for_node(JobShape(**shape), node, MemoryPolicy())
    assert roomy.bytes_on("nvme") == 0
    budget = 5 * GiB // 4
    tight = plan_for_node(JobShape(**shape, engine="memstrata"), node, MemoryPolicy(engine="memstrata",
                                                                                      dram_budget=budget))
    assert tight.feasible, tight.verdict()
    assert tight.category("pinned").bytes == 346_398_720 and tight.optimizer_read_ahead == 1
    assert tight.category("weights").on("dram") == 250_524_672 and tight.offload_device("weights") == "cpu"
    assert tight.category("master").on("dram") == 161_764_010
    assert tight.category("optimizer").on("dram") == 323_528_022
    assert tight.category("optimizer").on("nvme") == 1_002_098_688 - 323_528_022
    assert tight.bytes_on("dram") - tight.category("working").bytes - tight.category("build").bytes == budget
    small = plan_for_node(JobShape(**shape, engine="memstrata"), node, MemoryPolicy(engine="memstrata",
                                                                                      dram_budget=GiB))
    assert small.feasible, small.verdict()
    assert small.category("master").on("dram") + small.category("optimizer").on("dram") == 166_410_240
    assert small.category("weights").on("nvme") == 0 and small.category("pinned").bytes == 396_845_056
    smaller = plan_for_node(JobShape(**shape, engine="memstrata"), node, MemoryPolicy(engine="memstrata",
                                                                                        dram_budget=3 * GiB // 4))
    assert smaller.feasible, smaller.verdict()
    assert 0 < smaller.category("weights").on("nvme") < smaller.category("weights").bytes
    assert smaller.category("master").on("dram") + smaller.category("optimizer").on("dram") == 0
    assert smaller.category("pinned").bytes == 105_619_456 + 415_707_136
    stock = plan_for_node(JobShape(**shape), node, MemoryPolicy(dram_budget=GiB))
    assert not stock.feasible
    assert "page-locked buffers of 1.7 GiB exceed the 1.0 GiB" in stock.verdict()


def test_a_tight_budget_streams_smaller_sub_groups() -> None:
    """gpt-125m on the CPU, seq 512: at 0.75 GiB the model's unit (a layer, 7,087,872 elements) fits; below, the
    planner shrinks the unit by UNIT_STEP (7/10, whole slices: 4,960,256, 3,471,360, 2,428,928, 1,699,840,
    1,189,888) and takes the largest that fits still reading one sub-group ahead: 3,471,360 at 0.6 GiB, 2,428,928 at
    0.5, 1,699,840 at 0.45, 1,189,888 at 0.4. Only at 0.39 GiB, where no unit fits so, does it read each one when it
    needs it, at the largest unit that fits without (the smallest here). Never below MIN_SUBGROUP_UNIT. The
    runtime's ZeRO-3 sub_group_size is the plan's unit (memstrata.runtime.train.dsconfig)."""
    from memstrata.plan.assignment import MIN_SUBGROUP_UNIT

    shape = dict(model=PRESETS["gpt-125m"], sequence_length=512, micro_batch=1, gpus=0, engine="memstrata")
    node = _small_node(64 * GiB, gpus=0, nvme=[100 * GiB])

    def at(gib: float) -> Plan:
        return plan_for_node(JobShape(**shape), node, MemoryPolicy(engine="memstrata", dram_budget=int(gib * GiB)))

    plans = {gib: at(gib) for gib in (0.75, 0.6, 0.5, 0.45, 0.4, 0.39)}
    assert all(p.feasible for p in plans.values()), {g: p.verdict() for g, p in plans.items()}
    assert [p.sub_group_elements for p in plans.values()] == [7_087_872, 3_471_360, 2_428_928, 1_699_840,
                                                              1_189_888, 1_189_888]
    assert [p.optimizer_read_ahead for p in plans.values()] == [1, 1, 1, 1, 1, 0]
    pinned = [p.category("pinned").bytes for p in plans.values()]
    assert pinned == sorted(pinned, reverse=True) and pinned[0] == 105_619_456 + 415_707_136
    assert min(p.sub_group_elements or 0 for p in plans.values()) >= MIN_SUBGROUP_UNIT
    # Where no unit fits, the verdict is the model's unit's, read one ahead: what a user changes is the budget.
    none = at(0.3)
    assert not none.feasible and none.sub_group_elements == 7_087_872


def test_reading_ahead_at_a_smaller_unit_is_preferred_to_waiting_at_a_larger_one() -> None:
    """At every budget of the tight range, the plan reads one ahead whenever some unit lets it: a plan without
    read-ahead is only chosen where no unit of the planner's steps fits with it (each checked here)."""
    from memstrata.plan.assignment import _settle, _smaller_units

    shape = dict(model=PRESETS["gpt-125m"], sequence_length=512, micro_batch=1, gpus=0, engine="memstrata")
    node = _small_node(64 * GiB, gpus=0, nvme=[100 * GiB])
    waiting = 0
    for mib in range(395, 780, 5):
        policy = MemoryPolicy(engine="memstrata", dram_budget=mib << 20)
        plan = plan_for_node(JobShape(**shape), node, policy)
        if plan.feasible and plan.optimizer_read_ahead == 0:
            waiting += 1
            assert not any(_settle(s, node, policy, read_ahead=1).feasible for s in _smaller_units(JobShape(**shape)))
    assert waiting  # the range reaches down to where some budget has no unit that reads ahead


def test_dram_budget_is_a_continuum_for_memstrata() -> None:
    """Every budget from the least that fits to all of it: NVMe bytes only ever shrink as the budget grows, and a
    budget that holds everything is an all-DRAM plan with no namespace."""
    shape = dict(model=PRESETS["gpt-125m"], sequence_length=512, micro_batch=1, gpus=0, engine="memstrata")
    node = _small_node(64 * GiB, gpus=0, nvme=[100 * GiB])
    last_nvme = None
    for budget in (5 * GiB // 4, 3 * GiB // 2, 7 * GiB // 4, 2 * GiB, 3 * GiB):
        plan = plan_for_node(JobShape(**shape), node, MemoryPolicy(engine="memstrata", dram_budget=budget))
        assert plan.feasible, (budget, plan.verdict())
        nvme = plan.bytes_on("nvme")
        assert last_nvme is None or nvme < last_nvme or nvme == 0, (budget, nvme, last_nvme)
        last_nvme = nvme
    assert last_nvme == 0 and plan.nvme_namespaces == [] and "memstrata.dev/nvme-ns" not in plan.requests


@pytest.mark.parametrize("sizes,count,want", [
    ([1 << 40, 4 << 40, 2 << 40], 2, ["nvme1n1", "nvme2n1"]),          # the largest ones
    ([2 << 40, 2 << 40, 2 << 40], 2, ["nvme0n1", "nvme1n1"]),          # equal sizes: by name
    ([1 << 40, 4 << 40, 4 << 40, 8 << 40], 3, ["nvme3n1", "nvme1n1", "nvme2n1"]),
])
def test_planner_counts_the_namespaces_the_device_plugin_prefers(sizes: list[int], count: int,
                                                                 want: list[str]) -> None:
    """The device plugin answers the kubelet's GetPreferredAllocation with the same rule
    (memstrata.api.namespacechoice), so the pod gets these; striping is bounded by the smallest."""
    job = JobShape(model=PRESETS["llama3-70b"], sequence_length=8192, micro_batch=1, gpus=1, engine="memstrata")
    plan = plan_for_node(job, _small_node(512 * GiB, nvme=sizes), MemoryPolicy(engine="memstrata",
                                                                               nvme_namespaces=count))
    assert plan.nvme_namespaces == want
    nvme = next(s for s in plan.strata if s.stratum == "nvme")
    assert nvme.capacity == count * min(sizes[int(n[4])] for n in want)


def test_same_inputs_same_plan(cxl_node: NodeInventory) -> None:
    job = JobShape(model=PRESETS["qwen2.5-14b"], sequence_length=16384, micro_batch=2, gpus=1)
    a = plan_for_node(job, cxl_node, MemoryPolicy(nvme_namespaces=2))
    b = plan_for_node(job, cxl_node.model_copy(deep=True), MemoryPolicy(nvme_namespaces=2))
    assert a.model_dump() == b.model_dump()


def test_planner_imports_neither_torch_nor_io_modules() -> None:
    code = ("import sys, memstrata.plan, memstrata.plan.table; "
            "bad = [m for m in ('torch', 'deepspeed', 'kubernetes', 'kopf') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
