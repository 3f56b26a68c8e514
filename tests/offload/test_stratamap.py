"""The swap layer's settings from the plan: resident state and the namespace sizes follow `memory.dramBudget`,
and the device plugin's env names the namespaces and CXL nodes where there is one."""
from __future__ import annotations

from pathlib import Path

import pytest

from memstrata.api import load_job
from memstrata.api.architecture import PRESETS, ModelArchitecture
from memstrata.api.finetunejob import MemoryPolicy
from memstrata.api.inventory import NodeInventory, NumaNode, NvmeNamespace
from memstrata.api.strataplan import Allocation, CategoryPlan, Plan
from memstrata.plan import JobShape, plan_for_node, plan_job
from memstrata.runtime.swap.layer import SwapSettings
from memstrata.plan.stock import align_elements, largest_param
from memstrata.runtime.swap.stratamap import create_file_namespaces, subgroup_state_bytes, swap_settings

MiB, GiB = 1 << 20, 1 << 30
REPO = Path(__file__).resolve().parents[2]
# 8 layers of hidden 512 and a 512-token vocabulary: sub-groups (one layer each) are small next to the
# optimizer state, so a few MiB of budget buy whole sub-groups.
ARCH = ModelArchitecture(family="gpt", layers=8, hidden=512, intermediate=2048, heads=8, kv_heads=8, vocab=512,
                         tied=True, max_positions=512)
NODE = NodeInventory(numa_nodes=[NumaNode(id=0, cpus=[0, 1], memory_bytes=64 * GiB)],
                     nvme_namespaces=[NvmeNamespace(name="/scratch", size_bytes=1 << 40, free=True)])


def _budget_plan(budget_mib: int, arch: ModelArchitecture = ARCH) -> Plan:
    job = JobShape(model=arch, sequence_length=128, micro_batch=1, gpus=0, engine="memstrata")
    plan = plan_for_node(job, NODE, MemoryPolicy(engine="memstrata", dram_budget=budget_mib * MiB))
    assert plan.feasible, plan.verdict()
    return plan


def _plan(namespaces: list[str], cxl: list[int] | None = None, categories: list[CategoryPlan] | None = None) -> Plan:
    return Plan(parameters=10_000_000, engine="memstrata", feasible=True, categories=categories or [], strata=[],
                nvme_namespaces=namespaces, cxl_nodes=cxl or [])


def _on(plan: Plan, stratum: str, *categories: str) -> int:
    return sum(plan.category(c).on(stratum) for c in categories)


def test_a_larger_dram_budget_keeps_more_state_resident_and_shrinks_the_namespaces(tmp_path: Path) -> None:
    plans = [_budget_plan(b) for b in (160, 336, 384, 2048)]
    got = [swap_settings(p, ARCH, job="j", run_dir=tmp_path, env={}) for p in plans]
    resident = [s.settings.resident_state_bytes for s in got]
    # The plan's DRAM bytes for master + moments are what the runtime keeps resident, byte for byte.
    assert resident == [_on(p, "dram", "master", "optimizer") for p in plans]
    assert resident[0] < resident[1] < resident[2] and all(s.settings.cache_subgroups == 1 for s in got)
    # Only what spills sizes the stratum: each larger budget gives smaller namespaces, the last none at all.
    sizes = [s.file_bytes for s in got[:3]]
    assert sizes[0] > sizes[1] > sizes[2] > 0
    assert got[3].settings.no_nvme and got[3].settings.nvme == [] and got[3].file_namespaces == []
    assert plans[3].bytes_on("nvme") == 0 and plans[3].nvme_namespaces == []


def test_namespace_sizes_are_the_plans_nvme_bytes_plus_the_stated_slack(tmp_path: Path) -> None:
    plan = _budget_plan(336)
    spilled = plan.bytes_on("nvme")
    assert 0 < spilled < sum(plan.category(c).bytes for c in ("master", "optimizer", "weights"))
    # One sub-group of state and one 16-bit tensor of slack: whole sub-groups and tensors are kept resident.
    nvme = spilled + subgroup_state_bytes(ARCH) + align_elements(largest_param(ARCH)) * 4
    extents = 5 * 100  # the GPT-2 model's 100 parameter tensors: one extent each, and at most 4 per sub-group
    one = swap_settings(plan, ARCH, job="j", run_dir=tmp_path, env={})
    assert one.file_bytes == -(-(MiB + nvme + extents * 4096) // MiB) * MiB
    two = swap_settings(plan.model_copy(update={"nvme_namespaces": ["/a", "/b"]}), ARCH, job="j", run_dir=tmp_path,
                        env={})
    assert two.file_namespaces == [str(tmp_path / "nvme0.img"), str(tmp_path / "nvme1.img")]
    # Striped: half each, and per extent up to two stripe units more on the first namespace.
    assert two.file_bytes == -(-(MiB + -(-nvme // 2) + extents * (4096 + 2 * MiB)) // MiB) * MiB


@pytest.mark.parametrize("budget", [None, 3800 << 10])
def test_the_default_demo_streams_part_of_its_state_and_weights(tmp_path: Path, budget: int | None) -> None:
    """The tiny example keeps its weights in DRAM (they are read twice a step) and streams half its optimizer
    state; under 3.9 MiB the weights stream too, and the parameter swapper keeps the plan's DRAM share of them."""
    job = load_job(REPO / "examples" / "finetune-tiny.yaml")
    if budget is not None:
        job = job.model_copy(update={"spec": job.spec.model_copy(update={
            "memory": job.spec.memory.model_copy(update={"dram_budget": budget})})})
    node = NODE.model_copy(update={"numa_nodes": [NumaNode(id=0, cpus=[0, 1], memory_bytes=8 * GiB)]})
    plan = plan_job(job.spec, node)
    assert _on(plan, "nvme", "master", "optimizer") > 0
    assert (_on(plan, "nvme", "weights") > 0) == (budget is not None)
    strata = swap_settings(plan, PRESETS["gpt-tiny"], job="j", run_dir=tmp_path, env={})
    assert strata.settings.cache_subgroups == SwapSettings().cache_subgroups == 1
    assert strata.settings.resident_state_bytes == _on(plan, "dram", "master", "optimizer")
    if budget is not None:  # the parameter swapper keeps the plan's DRAM share of the weights
        assert strata.settings.resident_weight_bytes == _on(plan, "dram", "weights")
    assert strata.settings.prefetch_subgroups == plan.optimizer_read_ahead
    assert strata.file_bytes >= MiB + plan.bytes_on("nvme")


def test_local_run_gets_one_sparse_file_namespace_per_plan_namespace(tmp_path: Path) -> None:
    strata = swap_settings(_budget_plan(160).model_copy(update={"cxl_nodes": [2]}), ARCH, job="j", run_dir=tmp_path,
                           env={})
    assert strata.source == "plan"
    assert strata.settings.nvme == [str(tmp_path / "nvme0.img")] == strata.file_namespaces
    assert strata.settings.cxl_nodes == [2] and strata.settings.job == "j"
    create_file_namespaces(strata)
    st = (tmp_path / "nvme0.img").stat()
    assert st.st_size == strata.file_bytes and st.st_blocks * 512 < 1 << 20, "sparse: no DRAM or disk spent up front"
    with pytest.raises(FileExistsError):
        create_file_namespaces(strata)  # never reuses (or truncates) a file it did not just create


def test_device_plugin_env_wins_over_the_plan_and_the_budget_still_follows_it(tmp_path: Path) -> None:
    env = {"MEMSTRATA_NVME_DEVICES": "/dev/nvme1n1,/dev/nvme2n1", "MEMSTRATA_CXL_NODES": "3,4"}
    plan = _budget_plan(336)
    strata = swap_settings(plan.model_copy(update={"cxl_nodes": [2]}), ARCH, job="j", run_dir=tmp_path, env=env)
    assert strata.source == "device-plugin" and strata.file_namespaces == []
    assert strata.settings.nvme == ["/dev/nvme1n1", "/dev/nvme2n1"] and strata.settings.cxl_nodes == [3, 4]
    assert strata.settings.resident_state_bytes == _on(plan, "dram", "master", "optimizer") > 0


def test_bad_plans_and_env_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="MEMSTRATA_CXL_NODES='a,b'"):
        swap_settings(_plan(["/s"]), ARCH, job="j", run_dir=tmp_path, env={"MEMSTRATA_CXL_NODES": "a,b"})
    # Nothing on NVMe and no namespace: an all-DRAM run, not an error.
    assert swap_settings(_plan([]), ARCH, job="j", run_dir=tmp_path, env={}).settings.no_nvme
    on_nvme = [CategoryPlan(category="optimizer", description="", bytes=3 * MiB,
                            placement=[Allocation(stratum="nvme", bytes=3 * MiB)])]
    with pytest.raises(ValueError, match=r"plan.nvme_namespaces is empty but plan.categories place 3.0 MiB on nvme"):
        swap_settings(_plan([], categories=on_nvme), ARCH, job="j", run_dir=tmp_path, env={})
    assert not list(tmp_path.iterdir()), "a refused plan leaves nothing behind"


def _checkpoints_on(*where: tuple[str, int]) -> list[CategoryPlan]:
    return [CategoryPlan(category="checkpoints", description="", bytes=sum(b for _, b in where),
                         placement=[Allocation(stratum=s, bytes=b) for s, b in where])]


def test_the_activation_pool_goes_where_the_plan_put_the_checkpoints(tmp_path: Path) -> None:
    plan = plan_job(load_job(REPO / "examples/finetune.yaml").spec, load_node_example())
    assert plan.category("checkpoints").on("cxl") == plan.category("checkpoints").bytes > 0
    settings = swap_settings(plan, plan_arch(), job="j", run_dir=tmp_path, env={}).settings
    assert settings.cxl_nodes == [1] and settings.activations_on_cxl
    # CXL full (or refused): the plan put them in DRAM, and so does the runtime although the node has CXL.
    in_dram = _plan([], cxl=[1], categories=_checkpoints_on(("dram", 8 * MiB)))
    assert not swap_settings(in_dram, ARCH, job="j", run_dir=tmp_path, env={}).settings.activations_on_cxl
    # Split: the pool follows the larger share.
    split = _plan([], cxl=[1], categories=_checkpoints_on(("cxl", 6 * MiB), ("dram", 2 * MiB)))
    assert swap_settings(split, ARCH, job="j", run_dir=tmp_path, env={}).settings.activations_on_cxl


def load_node_example() -> NodeInventory:
    from memstrata.api.manifest import load_node

    return load_node(REPO / "examples/node-cxl.yaml")


def plan_arch() -> ModelArchitecture:
    return load_job(REPO / "examples/finetune.yaml").spec.model.shape()


def test_each_rank_takes_the_plans_own_share_whatever_the_environment_says(tmp_path: Path) -> None:
    """The plan says how many ranks share the node (ranks_per_node) and counted each rank's bytes with it: the
    swap layer's DRAM shares are that split, not one recomputed from the process's environment."""
    job = JobShape(model=ARCH, sequence_length=128, micro_batch=1, gpus=0, engine="memstrata",
                   ranks_per_node=2)
    node = NODE.model_copy(update={"nvme_namespaces": [NvmeNamespace(name=f"/s{i}", size_bytes=1 << 40, free=True)
                                                       for i in range(2)]})
    plan = plan_for_node(job, node, MemoryPolicy(engine="memstrata", dram_budget=672 * MiB))
    assert plan.feasible and plan.ranks_per_node == 2, plan.verdict()
    assert _on(plan, "dram", "master", "optimizer") > 0
    for env in ({}, {"LOCAL_WORLD_SIZE": "1"}, {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}):
        settings = swap_settings(plan, ARCH, job="j", run_dir=tmp_path, env=env).settings
        assert settings.resident_state_bytes == _on(plan, "dram", "master", "optimizer") // 2
    with pytest.raises(ValueError, match=r"MEMSTRATA_NVME_DEVICES: 1 namespaces cannot serve the node's 2 ranks"):
        swap_settings(plan, ARCH, job="j", run_dir=tmp_path, env={"MEMSTRATA_NVME_DEVICES": "/dev/nvme1n1"})


def test_the_namespaces_split_over_the_plans_ranks_and_a_launcher_that_disagrees_is_refused(tmp_path: Path) -> None:
    """The device plugin's namespaces are shared by the node's ranks, each taking every ranks_per_node-th: the
    count is the plan's (its bytes per rank were counted with it), and a launcher that started another count of
    ranks is refused naming both, not given shares the plan never counted."""
    from memstrata.runtime.swap.layer import node_ranks

    job = JobShape(model=ARCH, sequence_length=128, micro_batch=1, gpus=0, engine="memstrata", ranks_per_node=2)
    node = NODE.model_copy(update={"nvme_namespaces": [NvmeNamespace(name=f"/s{i}", size_bytes=1 << 40, free=True)
                                                       for i in range(2)]})
    plan = plan_for_node(job, node, MemoryPolicy(engine="memstrata", dram_budget=672 * MiB))
    devices = {"MEMSTRATA_NVME_DEVICES": "/dev/nvme1n1,/dev/nvme2n1,/dev/nvme3n1,/dev/nvme4n1"}
    settings = swap_settings(plan, ARCH, job="j", run_dir=tmp_path, env=devices).settings
    assert settings.ranks_per_node == 2 and settings.nvme_shared
    assert node_ranks(settings, {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}) == 2
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=4: the launcher started 4 ranks on this node, but the "
                                         r"plan split the node's namespaces over plan.ranks_per_node=2"):
        node_ranks(settings, {"LOCAL_WORLD_SIZE": "4"})
    # A layer no plan made (a script of one's own around memstrata.initialize) takes the launcher's count.
    assert node_ranks(settings.model_copy(update={"ranks_per_node": None}), {"LOCAL_WORLD_SIZE": "4"}) == 4
    assert node_ranks(settings.model_copy(update={"ranks_per_node": None}), {}) == 1


def test_weights_on_any_addressable_stratum_stay_resident(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stratum that loads and stores reach (the registry says so) keeps its weights resident; one reached by
    block I/O, like NVMe, does not: a stratum added to the registry is counted with no change here."""
    from dataclasses import replace

    from memstrata.api import strata as registry
    from memstrata.runtime.swap.stratamap import resident_weight_bytes

    pmem = replace(registry.stratum("cxl"), name="pmem", title="PMem", resource=None, served=False)
    monkeypatch.setattr(registry, "REGISTRY", (*registry.REGISTRY, pmem))
    weights = CategoryPlan(category="weights", description="weights", bytes=7 * GiB, placement=[
        Allocation(stratum="dram", bytes=1 * GiB), Allocation(stratum="pmem", bytes=2 * GiB),
        Allocation(stratum="nvme", bytes=4 * GiB)])
    plan = Plan(parameters=1, engine="memstrata", feasible=True, categories=[weights], strata=[])
    assert resident_weight_bytes(plan) == 3 * GiB
    monkeypatch.setattr(registry, "REGISTRY", (*registry.REGISTRY[:-1], replace(pmem, addressable=False)))
    assert resident_weight_bytes(plan) == 1 * GiB


@pytest.mark.parametrize("delayed", [True, False])
def test_the_delayed_update_is_on_exactly_where_the_plan_counted_it(tmp_path: Path, delayed: bool) -> None:
    job = JobShape(model=ARCH, sequence_length=128, micro_batch=1, gpus=0, engine="memstrata", delayed_update=delayed)
    plan = plan_for_node(job, NODE, MemoryPolicy(engine="memstrata"))
    assert plan.delayed_update is delayed
    assert swap_settings(plan, ARCH, job="j", run_dir=tmp_path, env={}).settings.delayed_update is delayed
