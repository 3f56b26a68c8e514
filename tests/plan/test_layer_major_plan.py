"""Layer-major micro-batches in the plan (memstrata.api.layermajor): unset, the planner turns it on exactly where
weights go to NVMe and gradientAccumulation > 1, and then counts the activation checkpoints of all the step's
micro-batches; the spec can force it on or off, and a job that cannot run it is refused naming the field."""
from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from memstrata.api.architecture import PRESETS
from memstrata.api.finetunejob import FineTuneJobSpec, MemoryPolicy
from memstrata.api.manifest import load_node
from memstrata.api.inventory import NodeInventory
from memstrata.plan import JobShape, plan_for_node
from memstrata.plan.accounting import checkpoint_bytes


@pytest.fixture
def node(repo) -> NodeInventory:
    # Without its CXL expanders, which would take the weights a DRAM budget leaves out.
    return load_node(repo / "examples/node-cxl.yaml").model_copy(update={"cxl_nodes": []})


def _job(accumulation: int, **kw: Any) -> JobShape:
    return JobShape(model=PRESETS["llama3-8b"], sequence_length=4096, micro_batch=1, gpus=1, engine="memstrata",
                    gradient_accumulation=accumulation, loss_chunk_tokens=4096, **kw)


def _policy(dram: str | None) -> MemoryPolicy:
    return MemoryPolicy.model_validate({"engine": "memstrata", "nvmeNamespaces": 2,
                                        **({"dramBudget": dram} if dram else {})})


def test_on_where_weights_go_to_nvme_with_every_micro_batchs_checkpoints(node: NodeInventory) -> None:
    roomy = plan_for_node(_job(4), node, _policy(None))
    assert roomy.category("weights").on("nvme") == 0 and not roomy.layer_major
    assert roomy.category("checkpoints").bytes == checkpoint_bytes(_job(4))
    tight = plan_for_node(_job(4), node, _policy("32Gi"))
    assert tight.feasible and tight.category("weights").on("nvme") > 0
    assert tight.layer_major
    # 32 layers x 4096 tokens x 4096 hidden x 2 B, for each of the 4 micro-batches.
    assert tight.category("checkpoints").bytes == 4 * 32 * 4096 * 4096 * 2
    assert any(n.startswith("layer-major: the step's 4 micro-batches") for n in tight.notes)


def test_never_with_one_micro_batch_a_step_or_when_the_spec_says_no(node: NodeInventory) -> None:
    assert not plan_for_node(_job(1), node, _policy("32Gi")).layer_major
    off = plan_for_node(_job(4, layer_major=False), node, _policy("32Gi"))
    assert not off.layer_major and off.category("checkpoints").bytes == 32 * 4096 * 4096 * 2
    assert not any(n.startswith("layer-major") for n in off.notes)


def test_forced_on_with_the_weights_in_dram(node: NodeInventory) -> None:
    plan = plan_for_node(_job(2, layer_major=True), node, _policy(None))
    assert plan.layer_major and plan.category("weights").on("nvme") == 0
    assert plan.category("checkpoints").bytes == 2 * 32 * 4096 * 4096 * 2


@pytest.mark.parametrize(("change", "message"), [
    ({"training": {"gradientAccumulation": 1}}, "needs training.gradientAccumulation of 2 or more"),
    ({"training": {"activationCheckpointing": False}}, "needs training.activationCheckpointing"),
    ({"training": {"lossChunkTokens": 0}}, "needs training.lossChunkTokens above 0"),
    ({"memory": {"engine": "deepspeed"}}, "needs memory.engine: memstrata"),
])
def test_a_job_that_cannot_run_it_is_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    spec: dict[str, Any] = {"model": {"preset": "gpt-tiny"}, "dataset": {"synthetic": "copy"},
                            "training": {"steps": 10, "sequenceLength": 64, "gradientAccumulation": 4,
                                         "layerMajor": True}}
    FineTuneJobSpec.model_validate(spec)  # as it stands it can
    for key, fields in change.items():
        spec[key] = {**spec.get(key, {}), **fields}
    with pytest.raises(ValidationError, match=f"training.layerMajor: {message}"):
        FineTuneJobSpec.model_validate(spec)


def test_dropped_where_every_micro_batchs_checkpoints_break_the_fit(node: NodeInventory) -> None:
    # Llama-3-8B at 8192 tokens and 8 micro-batches: 8 x 32 x 8192 x 4096 x 2 B = 16 GiB of checkpoints more.
    job = JobShape(model=PRESETS["llama3-8b"], sequence_length=8192, micro_batch=1, gpus=1, engine="memstrata",
                   gradient_accumulation=8, loss_chunk_tokens=4096)
    plan = plan_for_node(job, node, _policy("24Gi"))
    assert plan.feasible and not plan.layer_major and plan.category("weights").on("nvme") > 0
    assert plan.notes[0].startswith("layer-major off: the activation checkpoints of all 8 micro-batches at once do "
                                    "not fit")
    forced = plan_for_node(job.model_copy(update={"layer_major": True}), node, _policy("24Gi"))
    assert forced.layer_major and not forced.feasible  # asked for by name: its shortfall is said, not dropped


def test_the_working_set_counts_every_micro_batchs_hidden_states_around_a_layer() -> None:
    from memstrata.plan import working_set

    one, four = _job(4, layer_major=False), _job(4, layer_major=True)
    # 3 x 4 micro-batches x 4096 tokens x 4096 hidden x 2 B, and the head's input of the 3 more micro-batches.
    from memstrata.plan.accounting import head_input_bytes

    head = 3 * 4096 * head_input_bytes(PRESETS["llama3-8b"], 2)
    assert working_set(four) - working_set(one) == 3 * 4 * 4096 * 4096 * 2 + head
