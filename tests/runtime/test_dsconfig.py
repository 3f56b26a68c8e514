"""The DeepSpeed config follows the plan, and every tuned setting is recorded with its reason."""
from __future__ import annotations

from pathlib import Path

from memstrata.api.architecture import PRESETS
from memstrata.api.finetunejob import MemoryPolicy, Training
from memstrata.api.inventory import NodeInventory, NumaNode, NvmeNamespace
from memstrata.api.units import GiB
from memstrata.plan import JobShape, Plan, plan_for_node
from memstrata.plan.stock import DS_MIN_AIO_BYTES, largest_param, param_tensors
from memstrata.runtime.train.dsconfig import build_ds_config

SWAP = Path("/scratch/run-1")
TINY = PRESETS["gpt-tiny"]
TRAINING = Training(steps=10, sequence_length=128, micro_batch=4, gradient_accumulation=2, learning_rate=1e-3)


def _node(dram: int) -> NodeInventory:
    return NodeInventory(numa_nodes=[NumaNode(id=0, cpus=[0, 1], memory_bytes=dram)],
                         nvme_namespaces=[NvmeNamespace(name="/scratch", size_bytes=100 * GiB, free=True)])


def _plan(model_name: str, dram: int) -> Plan:
    job = JobShape(model=PRESETS[model_name], sequence_length=128, micro_batch=4, gpus=0)
    return plan_for_node(job, _node(dram), MemoryPolicy())


def test_everything_in_dram_gives_cpu_offload() -> None:
    plan = _plan("gpt-tiny", 64 * GiB)
    assert plan.offload_device("weights") == plan.offload_device("master", "optimizer") == "cpu"
    ds = build_ds_config(plan, TINY, TRAINING, SWAP, on_gpu=False)
    zero = ds.config["zero_optimization"]
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert "nvme_path" not in str(ds.config)


def test_spilled_plan_gives_nvme_offload_with_buffers_sized_from_the_model() -> None:
    # gpt-125m's state (~1.9 GB) cannot live in 1 GiB of DRAM: the plan puts it on NVMe.
    plan = _plan("gpt-125m", GiB)
    arch = PRESETS["gpt-125m"]
    assert plan.offload_device("weights") == plan.offload_device("master", "optimizer") == "nvme"
    ds = build_ds_config(plan, arch, TRAINING, SWAP, on_gpu=False)
    zero = ds.config["zero_optimization"]
    param, optim = zero["offload_param"], zero["offload_optimizer"]
    assert param["device"] == optim["device"] == "nvme"
    assert param["nvme_path"] == optim["nvme_path"] == str(SWAP)
    # The embedding, 50304 x 768 = 38,633,472 elements, is the largest tensor; 1024-aligned it stays that.
    assert largest_param(arch) == 38_633_472
    assert param["buffer_size"] == 38_633_472
    assert 5 <= param["buffer_count"] <= param_tensors(arch)
    assert zero["stage"] == 3
    assert zero["stage3_param_persistence_threshold"] == 0
    assert zero["stage3_max_reuse_distance"] == 0
    # One sub-group is at least one layer (7,087,872 elements here) and at least the largest tensor.
    assert zero["sub_group_size"] == 38_633_472
    assert param["pin_memory"] is False and optim["pin_memory"] is False


def test_small_model_sub_groups_are_large_enough_to_be_swapped() -> None:
    plan = _plan("gpt-125m", GiB)  # any nvme plan; the shape below decides the sizes
    ds = build_ds_config(plan, TINY, TRAINING, SWAP, on_gpu=False)
    # gpt-tiny's layer (198,272) and largest tensor (65,536) are below DeepSpeed's 1 MiB swap minimum.
    assert ds.config["zero_optimization"]["sub_group_size"] == DS_MIN_AIO_BYTES // 4 == 262_144


def test_batch_precision_and_optimizer_come_from_training() -> None:
    ds = build_ds_config(_plan("gpt-tiny", 64 * GiB), TINY, TRAINING, SWAP, on_gpu=False)
    c = ds.config
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["train_batch_size"]) == (4, 2, 8)
    assert c["bf16"] == {"enabled": True} and c["fp16"] == {"enabled": False}
    assert c["optimizer"]["type"] == "AdamW" and c["optimizer"]["params"]["lr"] == 1e-3
    fp16 = build_ds_config(_plan("gpt-tiny", 64 * GiB), TINY, TRAINING.model_copy(update={"precision": "fp16"}),
                           SWAP, on_gpu=False).config
    assert fp16["fp16"]["enabled"] and not fp16["bf16"]["enabled"]


def test_adamw_and_clipping_come_from_the_spec_and_the_record_says_so() -> None:
    from memstrata.api.finetunejob import Optimizer

    training = TRAINING.model_copy(update={"optimizer": Optimizer(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
                                           "gradient_clipping": 0.5})
    ds = build_ds_config(_plan("gpt-tiny", 64 * GiB), TINY, training, SWAP, on_gpu=False)
    assert ds.config["optimizer"]["params"] == {"lr": 1e-3, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}
    assert ds.config["gradient_clipping"] == 0.5
    recorded = {s.key: s for s in ds.settings}
    for key, field in (("optimizer.params.betas", "beta1/beta2"), ("optimizer.params.eps", "eps"),
                       ("optimizer.params.weight_decay", "weightDecay"), ("gradient_clipping", "gradientClipping")):
        assert field in recorded[key].why and "spec.training" in recorded[key].why, recorded[key]


def test_values_equal_to_deepspeeds_defaults_are_not_reported_as_tuned() -> None:
    from memstrata.api.finetunejob import Optimizer

    # DeepSpeed's CPU Adam defaults and no clipping: nothing to explain in the report.
    training = TRAINING.model_copy(update={"optimizer": Optimizer(beta2=0.999), "gradient_clipping": 0.0})
    ds = build_ds_config(_plan("gpt-tiny", 64 * GiB), TINY, training, SWAP, on_gpu=False)
    assert ds.config["gradient_clipping"] == 0.0 and ds.config["optimizer"]["params"]["weight_decay"] == 0.0
    keys = {s.key for s in ds.settings}
    assert not keys & {"optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
                       "gradient_clipping"}, keys


def test_on_gpu_pins_host_memory() -> None:
    ds = build_ds_config(_plan("gpt-125m", GiB), PRESETS["gpt-125m"], TRAINING, SWAP, on_gpu=True)
    assert ds.config["zero_optimization"]["offload_param"]["pin_memory"] is True


def test_every_tuned_setting_is_recorded_with_a_reason() -> None:
    ds = build_ds_config(_plan("gpt-125m", GiB), PRESETS["gpt-125m"], TRAINING, SWAP, on_gpu=False)
    keys = {s.key for s in ds.settings}
    for key in ("zero_optimization.offload_param.buffer_size", "zero_optimization.offload_param.buffer_count",
                "zero_optimization.sub_group_size", "zero_optimization.stage3_max_reuse_distance",
                "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.offload_param.device"):
        assert key in keys
    for s in ds.settings:
        assert len(s.why) > 20, s
        value = ds.config
        for part in s.key.split("."):
            value = value[part]
        assert value == s.value, f"{s.key}: recorded {s.value}, config has {value}"


def test_pinned_pools_match_the_config_by_hand() -> None:
    """gpt-tiny, bf16: parameters 8 buffers x 65,536 elements x 2 B = 1,048,576 B; optimizer 4 buffers x
    (262,144 sub-group + 65,536 overshoot) x 4 B = 5,242,880 B; together 6,291,456 B — what the planner
    should count for a stock run with both groups on NVMe (not DeepSpeed's untuned defaults)."""
    from memstrata.plan.stock import pinned_pool_bytes

    assert pinned_pool_bytes(TINY, 2, params_on_nvme=True, optimizer_on_nvme=False) == 1_048_576
    assert pinned_pool_bytes(TINY, 2, params_on_nvme=False, optimizer_on_nvme=True) == 5_242_880
    assert pinned_pool_bytes(TINY, 2, params_on_nvme=True, optimizer_on_nvme=True) == 6_291_456
    zero = build_ds_config(_plan("gpt-125m", GiB), TINY, TRAINING, SWAP, on_gpu=False).config["zero_optimization"]
    p = zero["offload_param"]
    assert p["buffer_count"] * p["buffer_size"] * 2 == 1_048_576


def test_the_reduce_bucket_deepspeed_allocates_is_the_one_the_plan_counts_on_the_gpu() -> None:
    """ZeRO-3 allocates its gradient bucket whole on the compute device; left at 5e8 elements it is 0.93 GiB of bf16
    that no plan counted. Set to one layer (7,087,872 elements, 1024-aligned), which the working set counts
    (tests/plan/test_activation_checkpointing.py checks the sum for Llama-3-8B)."""
    from memstrata.plan.accounting import reduce_bucket_elements

    arch = PRESETS["gpt-125m"]
    ds = build_ds_config(_plan("gpt-125m", GiB), arch, TRAINING, SWAP, on_gpu=True)
    assert ds.config["zero_optimization"]["reduce_bucket_size"] == reduce_bucket_elements(arch) == 7_088_128
    assert reduce_bucket_elements(PRESETS["llama3-70b"]) == 500_000_000  # never more than DeepSpeed's own


def test_memstratas_engine_has_deepspeed_pin_on_the_cpu_too() -> None:
    """Its pools serve every pin (memstrata.runtime.swap.pinning), so no accelerator is needed; stock cannot pin
    here."""
    plan = _plan("gpt-125m", GiB).model_copy(update={"engine": "memstrata"})
    zero = build_ds_config(plan, PRESETS["gpt-125m"], TRAINING, SWAP, on_gpu=False).config["zero_optimization"]
    assert zero["offload_param"]["pin_memory"] is True and zero["offload_optimizer"]["pin_memory"] is True


def test_memstratas_sub_group_size_is_the_plans_unit() -> None:
    """ZeRO-3's sub_group_size on memstrata's engine is the unit the plan chose (smaller under a tight budget), so
    the runtime's sub-groups, slices and buffers are the ones the plan counted."""
    from memstrata.plan.accounting import memstrata_subgroup_elements

    arch = PRESETS["gpt-125m"]
    job = JobShape(model=arch, sequence_length=128, micro_batch=4, gpus=0, engine="memstrata")
    for budget, unit in ((GiB, memstrata_subgroup_elements(arch)), (GiB // 2, 2_428_928)):
        plan = plan_for_node(job, _node(64 * GiB), MemoryPolicy(engine="memstrata", dram_budget=budget))
        assert plan.feasible and plan.sub_group_elements == unit, (budget, plan.verdict())
        zero = build_ds_config(plan, arch, TRAINING, SWAP, on_gpu=False).config["zero_optimization"]
        assert zero["sub_group_size"] == unit
