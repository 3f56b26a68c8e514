"""Node selection: fits; then fewest bytes on slower strata; then spread — and the two ways to say no."""
from __future__ import annotations

import pytest
from ftj_factories import inventory, job_dict, node_dict, pod_dict

from memstrata.operator.nodes import node_view, pod_use, quantity, usage_by_node
from memstrata.operator.observe import job_view
from memstrata.operator.scheduling import PlanCache, place
from memstrata.plan import plan_job

SPEC = job_view(job_dict()).spec  # Llama-3-8B, 32K context, 1 GPU, memstrata engine, 2 NVMe namespaces


def nodes(*items):
    return [node_view(n) for n in items]


def test_prefers_the_node_with_no_bytes_on_slower_strata():
    candidates = nodes(
        node_dict("a-nvme", inventory("a-nvme", dram_gib=128)),              # spills optimizer state to NVMe
        node_dict("b-cxl", inventory("b-cxl", dram_gib=512, cxl_gib=256)),   # puts checkpoints on CXL
        node_dict("c-dram", inventory("c-dram", dram_gib=1024)),             # everything in DRAM
    )
    p = place(SPEC, candidates, {})
    assert p.outcome == "chosen" and p.node == "c-dram"
    assert p.plan is not None and p.plan.slow_bytes() == (0, 0)


def test_cxl_beats_nvme_when_neither_node_fits_in_dram():
    p = place(SPEC, nodes(node_dict("a-nvme", inventory("a-nvme", dram_gib=128)),
                          node_dict("b-cxl", inventory("b-cxl", dram_gib=512, cxl_gib=256))), {})
    assert p.node == "b-cxl"


def test_spreads_over_equal_nodes_by_memstrata_pods():
    same = [node_dict(n, inventory(n, dram_gib=1024, gpus=4)) for n in ("n1", "n2", "n3")]
    busy = [pod_use(pod_dict(f"x{i}", i, "Running", node=n, requests={"nvidia.com/gpu": "1"}))
            for i, n in enumerate(["n1", "n1", "n2"])]
    p = place(SPEC, nodes(*same), usage_by_node(u for u in busy if u))
    assert p.node == "n3"


def test_same_inputs_same_choice_by_name():
    same = nodes(*[node_dict(n, inventory(n, dram_gib=1024)) for n in ("zeta", "alpha", "mid")])
    assert {place(SPEC, same, {}).node for _ in range(3)} == {"alpha"}


def test_no_room_now_when_gpus_are_taken_and_names_why():
    candidates = nodes(node_dict("g1", inventory("g1", dram_gib=1024, gpus=1)),
                       node_dict("g2", inventory("g2", dram_gib=1024, gpus=1), cordoned=True))
    taken = pod_use(pod_dict("other", 0, "Running", node="g1", requests={"nvidia.com/gpu": "1"}))
    p = place(SPEC, candidates, usage_by_node([taken]))
    assert p.outcome == "no-room"
    assert "g1: nvidia.com/gpu needs 1, 0 free" in p.message and "g2: cordoned" in p.message


def test_room_frees_when_the_pod_terminates():
    candidates = nodes(node_dict("g1", inventory("g1", dram_gib=1024, gpus=1)))
    done = pod_use(pod_dict("other", 0, "Succeeded", node="g1", requests={"nvidia.com/gpu": "1"}))
    assert done is None  # a terminated pod holds nothing
    assert place(SPEC, candidates, {}).node == "g1"


def test_not_ready_or_tainted_nodes_wait_but_gpu_taint_is_tolerated():
    candidates = nodes(
        node_dict("down", inventory("down", dram_gib=1024), ready=False),
        node_dict("tainted", inventory("tainted", dram_gib=1024), taints=[{"key": "x", "effect": "NoSchedule"}]),
    )
    p = place(SPEC, candidates, {})
    assert p.outcome == "no-room" and "down: not Ready" in p.message and "tainted x:NoSchedule" in p.message
    gpu_tainted = nodes(node_dict("gpu", inventory("gpu", dram_gib=1024),
                                  taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]))
    assert place(SPEC, gpu_tainted, {}).node == "gpu"


def test_impossible_job_names_the_shortfall_per_stratum():
    small = nodes(node_dict("small", inventory("small", dram_gib=64, nvme=0)),
                  node_dict("nogpu", inventory("nogpu", dram_gib=64, nvme=0, gpus=0)))
    p = place(SPEC, small, {})
    assert p.outcome == "impossible"
    # The planner spills what DRAM cannot hold to NVMe, so NVMe is where the bytes are missing (DRAM also
    # holds the model-build transient, 2.36 GiB, and the update's widened gradient, 0.59 GiB, before any state
    # is placed).
    assert [s.stratum for s in p.shortfalls] == ["nvme"]
    nvme = p.shortfalls[0]
    assert nvme.missing_bytes == pytest.approx((55.1 + 15.0 + 2.36 + 0.59) * 2**30, rel=0.01)
    assert "closest is small" in p.message and "NVMe short by 73.0 GiB" in p.message
    assert "wants 2 free namespaces, node has 0" in p.message


def test_impossible_lists_every_short_stratum_once():
    tiny_gpu = nodes(node_dict("tiny", inventory("tiny", dram_gib=4, nvme=0, hbm_gib=8)))
    p = place(SPEC, tiny_gpu, {})
    strata = [s.stratum for s in p.shortfalls]
    assert p.outcome == "impossible" and len(strata) == len(set(strata)) and {"hbm", "dram", "nvme"} <= set(strata)
    assert p.message.index("HBM") < p.message.index("DRAM") < p.message.index("NVMe")


def test_node_without_inventory_is_ignored_and_none_at_all_waits():
    assert place(SPEC, nodes(node_dict("plain", None)), {}).outcome == "no-room"
    p = place(SPEC, nodes(node_dict("plain", None), node_dict("m", inventory("m", dram_gib=1024))), {})
    assert p.node == "m"


def test_capacity_advertised_below_the_plan_is_impossible_there():
    n = node_dict("g", inventory("g", dram_gib=1024))
    n["status"]["allocatable"]["nvidia.com/gpu"] = "0"  # device plugin reports the GPU unhealthy
    p = place(SPEC, nodes(n), {})
    assert p.outcome == "impossible" and "nvidia.com/gpu: needs 1, node advertises 0" in p.message


def test_plan_cache_plans_each_hardware_type_once():
    cache = PlanCache()
    fleet = nodes(*[node_dict(f"n{i}", inventory(f"n{i}", dram_gib=1024)) for i in range(50)])
    for _ in range(20):
        place(SPEC, fleet, {}, cache)
    assert cache.misses == 1 and cache.hits == 20 * 50 - 1


@pytest.mark.parametrize("text,value", [("4", 4), ("0", 0), ("1k", 1000), ("2Ki", 2048), ("500m", 1), ("1.5G", 1500000000)])
def test_quantity(text, value):
    assert quantity(text) == value


def test_quantity_rejects_garbage():
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        quantity("lots")


def test_init_containers_count_once_at_their_largest():
    from memstrata.operator.nodes import pod_requests

    spec = {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "initContainers": [{"resources": {"requests": {"nvidia.com/gpu": "2"}}},
                               {"resources": {"requests": {"nvidia.com/gpu": "1"}}}]}
    assert pod_requests(spec)["nvidia.com/gpu"] == 2


def test_no_room_now_when_the_nodes_memory_is_taken_though_gpus_are_free():
    """The pod requests the plan's host memory, and the scheduler will not bind it where the node's
    allocatable memory (256Gi here) minus other pods' requests is less; the operator must not either."""
    candidates = nodes(node_dict("g1", inventory("g1", dram_gib=1024, gpus=2)))
    taken = pod_use(pod_dict("other", 0, "Running", node="g1", requests={"memory": "200Gi"}))
    p = place(SPEC, candidates, usage_by_node([taken]))
    assert p.outcome == "no-room" and "g1: memory needs " in p.message and "56.0 GiB free" in p.message
    assert place(SPEC, candidates, {}).outcome == "chosen"


def test_a_node_advertising_less_memory_than_the_pod_requests_can_never_hold_it():
    small = node_dict("tiny-mem", inventory("tiny-mem", dram_gib=1024))
    small["status"]["allocatable"]["memory"] = "8Gi"
    p = place(SPEC, nodes(small), {})
    assert p.outcome == "impossible" and "memory: needs " in p.message and "node advertises 8.0 GiB" in p.message


def test_deepspeed_goes_only_where_nothing_swaps_to_raw_namespaces_and_else_fails_by_name():
    doc = job_dict()
    doc["spec"]["memory"]["engine"] = "deepspeed"
    spec = job_view(doc).spec
    spill = node_dict("a-nvme", inventory("a-nvme", dram_gib=128))  # the plan puts optimizer state on NVMe
    roomy = node_dict("c-dram", inventory("c-dram", dram_gib=1024))
    assert place(SPEC, nodes(spill), {}).outcome == "chosen"  # memstrata's engine writes the namespaces itself
    p = place(spec, nodes(spill), {})
    assert p.outcome == "impossible" and p.reason == "EngineCannotUseNamespaces"
    assert "spec.memory.engine: deepspeed" in p.message and "memory.engine: memstrata" in p.message
    # The words the pod and a local run refuse it with (tests/runtime/test_deepspeed_swap_target.py).
    refusal = plan_job(spec, inventory("a-nvme", dram_gib=128)).stock_swap_refusal()
    assert refusal is not None and p.message.startswith(refusal)
    chosen = place(spec, nodes(spill, roomy), {})
    assert chosen.outcome == "chosen" and chosen.node == "c-dram"
