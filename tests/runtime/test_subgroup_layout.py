"""The planner's picture of a model's tensors and sub-groups is the real model's: the ordered tensor list the
planner cuts into sub-groups (ModelArchitecture.tensor_sizes, from its family) equals `model.parameters()` of
the `transformers` model memstrata builds, for every preset family, so the buffers it plans are the ones a run
needs."""
from __future__ import annotations

import pytest

from memstrata.api.architecture import PRESETS
from memstrata.plan.accounting import JobShape, group_tensors, memstrata_subgroup_elements, subgroup_sizes


def _real_sizes(name: str) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    from memstrata.runtime.train.model.hfmodel import preset_config

    with torch.device("meta"):  # shapes only: no memory, no random init
        model = AutoModelForCausalLM.from_config(preset_config(PRESETS[name], 128))
    return [p.numel() for p in model.parameters()]


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-125m", "llama3-8b", "qwen2.5-14b", "mistral-7b", "mistral-nemo-12b",
                                  "gemma-2b", "gemma-7b", "phi3-mini",
                                  "qwen3-0.6b", "qwen3-8b"])
def test_the_planned_tensor_list_is_the_models(name: str) -> None:
    assert PRESETS[name].tensor_sizes() == _real_sizes(name)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_sub_groups_hold_every_element_once_and_big_tensors_alone(world: int) -> None:
    arch = PRESETS["gpt-125m"]
    job = JobShape(model=arch, sequence_length=128, micro_batch=1, gpus=0, engine="memstrata",
                   ranks_per_node=world)
    parts = [-(-n // world) for n in arch.tensor_sizes()]
    unit = memstrata_subgroup_elements(arch)
    groups = group_tensors(parts, unit)
    assert sorted(i for g in groups for i in g) == list(range(len(parts)))
    for g in groups:
        if any(parts[i] >= unit for i in g):
            assert len(g) == 1, "a tensor of at least the unit forms a sub-group of its own"
        else:
            assert sum(parts[i] for i in g) < 2 * unit
    assert sum(subgroup_sizes(job)) == sum(parts)
