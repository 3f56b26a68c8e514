"""A plan is for ONE node of a distributed job: ZeRO-3 partitions the model state over every rank of the
job, while each rank of the node keeps its own working set, buffers and activation checkpoints. Numbers
computed by hand.

Llama-3-8B: P = 8,030,261,248. Whole job, bf16: weights = gradients = 2P = 16,060,522,496, master 4P =
32,121,044,992, Adam moments 8P = 64,242,089,984. gpt-125m: P = 125,262,336, weights 2P = 250,524,672.
"""
from __future__ import annotations

from typing import Any

import pytest

from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.inventory import Gpu, NodeInventory, NumaNode, NvmeNamespace
from memstrata.api.units import GiB
from memstrata.plan import plan_job

PER_RANK = ("working", "build", "pinned", "checkpoints")
PARTITIONED = ("weights", "gradients", "master", "optimizer")


def _spec(preset: str = "llama3-8b", *, gpus: int = 1, nodes: int = 1, ranks: int | None = None,
          memory: dict[str, Any] | None = None, seq: int = 4096, ga: int = 1) -> FineTuneJobSpec:
    resources: dict[str, Any] = {"gpus": gpus, "nodes": nodes}
    if ranks is not None:
        resources["ranksPerNode"] = ranks
    return FineTuneJobSpec.model_validate({
        "model": {"preset": preset}, "dataset": {"synthetic": "copy"},
        "training": {"sequenceLength": seq, "microBatch": 2, "gradientAccumulation": ga, "steps": 10},
        "resources": resources, "memory": {"engine": "memstrata", **(memory or {})}})


def _node(*, dram: int = 1024 * GiB, gpus: int = 1, nvme: int = 2, controller: str = "") -> NodeInventory:
    return NodeInventory(
        hostname="n1", numa_nodes=[NumaNode(id=0, cpus=[0, 1], memory_bytes=dram)],
        nvme_namespaces=[NvmeNamespace(name=f"nvme{i}n1", controller=controller, size_bytes=4 << 40, free=True)
                         for i in range(nvme)],
        gpus=[Gpu(index=i, hbm_bytes=80 * GiB) for i in range(gpus)])


def test_two_nodes_need_half_the_optimizer_state_per_node() -> None:
    one, two = plan_job(_spec(nodes=1), _node()), plan_job(_spec(nodes=2), _node())
    assert one.feasible and two.feasible, (one.verdict(), two.verdict())
    assert one.category("optimizer").bytes == 64_242_089_984
    assert two.category("optimizer").bytes == 32_121_044_992             # 8P / 2 ranks, one of them here
    assert two.category("master").bytes == 16_060_522_496
    assert two.category("weights").bytes == two.category("gradients").bytes == 8_030_261_248
    for name in PER_RANK:                                                 # each node still runs a whole rank
        assert two.category(name).bytes == one.category(name).bytes, name
    assert (two.nodes, two.ranks_per_node, two.world_size) == (2, 1, 2)
    assert (one.nodes, one.ranks_per_node, one.world_size) == (1, 1, 1)
    assert two.bytes_on("dram") < one.bytes_on("dram")


def test_more_ranks_on_the_cpu_double_what_each_process_needs_not_the_partitioned_state() -> None:
    one = plan_job(_spec("gpt-125m", gpus=0, seq=512), _node(gpus=0))
    two = plan_job(_spec("gpt-125m", gpus=0, seq=512, ranks=2), _node(gpus=0))
    assert one.feasible and two.feasible, (one.verdict(), two.verdict())
    for name in PER_RANK:
        if one.category(name).bytes and name != "pinned":
            assert two.category(name).bytes == 2 * one.category(name).bytes, name
            assert two.category(name).rank_bytes == one.category(name).rank_bytes, name
    # The locked buffers are each process's own, for its own partition's sub-groups (the update widens one
    # sub-group's gradient at a time): one set per rank, each no larger than the single rank's.
    assert two.category("pinned").bytes == 2 * two.category("pinned").rank_bytes
    assert 0 < two.category("pinned").rank_bytes <= one.category("pinned").rank_bytes
    for name in PARTITIONED:                                              # 1 node x 2 ranks: all of it here
        assert two.category(name).bytes == one.category(name).bytes, name
        assert two.category(name).rank_bytes == one.category(name).bytes // 2, name
    assert two.category("weights").rank_bytes == 125_262_336              # 2P / 2
    assert two.category("working").placement[0].stratum == "dram"         # on the CPU the compute is DRAM
    assert two.rank_bytes["dram"] * 2 == two.bytes_on("dram")
    assert two.world_size == 2 and two.ranks_per_node == 2 and two.nodes == 1


def test_the_partition_is_rounded_up_per_rank() -> None:
    """gpt-125m weights over 5 nodes: 250,524,672 / 5 = 50,104,934.4 -> 50,104,935 B on each rank."""
    plan = plan_job(_spec("gpt-125m", gpus=0, nodes=5, seq=512), _node(gpus=0))
    assert plan.category("weights").bytes == 50_104_935
    assert plan.world_size == 5


def test_global_batch_is_micro_batch_x_accumulation_x_world() -> None:
    plan = plan_job(_spec(gpus=2, nodes=3, ga=4), _node(gpus=2, nvme=2))
    assert plan.global_batch == 2 * 4 * 6 and plan.world_size == 6 and plan.ranks_per_node == 2


@pytest.mark.parametrize("requested,ranks,want", [(1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2), (3, 2, 4),
                                                  (1, 4, 4), (5, 4, 8)])
def test_each_rank_gets_its_own_namespaces(requested: int, ranks: int, want: int) -> None:
    """Under a small DRAM budget the optimizer state goes to NVMe, so the pod requests namespaces: at least one
    per rank of the node and a multiple of the ranks (the runtime gives local rank r those with i % ranks == r)."""
    spec = _spec(gpus=ranks, memory={"nvmeNamespaces": requested, "dramBudget": "60Gi"})
    plan = plan_job(spec, _node(gpus=ranks, nvme=8))
    assert plan.feasible, plan.verdict()
    assert plan.bytes_on("nvme") > 0
    assert plan.requests["memstrata.dev/nvme-ns"] == want == len(plan.nvme_namespaces)
    rounded = [n for n in plan.notes if "rounded up" in n]
    assert bool(rounded) == (want != requested)
    if rounded:
        assert f"memory.nvmeNamespaces {requested} rounded up to {want}" in rounded[0]


def test_a_node_with_too_few_namespaces_for_its_ranks_cannot_hold_the_job() -> None:
    plan = plan_job(_spec(gpus=2, memory={"nvmeNamespaces": 1, "dramBudget": "40Gi"}), _node(gpus=2, nvme=1))
    assert not plan.feasible
    nvme = [s for s in plan.shortfalls if s.stratum == "nvme" and "namespaces" in s.message]
    assert nvme, plan.verdict()
    assert "wants 2 free namespaces" in nvme[0].message and "node has 1" in nvme[0].message
    assert "rounded up to a multiple of 2 ranks" in nvme[0].message


def test_a_local_scratch_directory_serves_every_rank() -> None:
    """`memstrata run` on this machine: the scratch directory is one 'namespace' in which each rank creates its
    own files, so two ranks do not need two of them."""
    node = _node(gpus=0, nvme=1, controller="scratch-directory")
    plan = plan_job(_spec("gpt-125m", gpus=0, seq=512, ranks=2, memory={"dramBudget": "1536Mi"}), node)
    assert plan.feasible, plan.verdict()
    assert plan.bytes_on("nvme") > 0 and plan.nvme_namespaces == ["nvme0n1"]
    assert any("each of the 2 ranks stripes over its own files" in n for n in plan.notes)


def test_old_plans_without_the_new_fields_still_load() -> None:
    plan = plan_job(_spec(nodes=2), _node())
    wire = plan.model_dump(mode="json")
    for key in ("nodes", "ranks_per_node", "world_size", "global_batch", "rank_bytes", "notes"):
        wire.pop(key)
    for c in wire["categories"]:
        c.pop("rank_bytes")
    old = type(plan).model_validate(wire)
    assert old.world_size == 1 and old.global_batch == 0 and old.rank_bytes == {}
