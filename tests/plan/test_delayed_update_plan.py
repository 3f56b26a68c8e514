"""spec.training.update delayed (memstrata.api.updatemode): refused on the stock engine naming the field, and
planned with the 16-bit shadows of the trained weights (the runtime's swap settings follow the plan:
tests/offload/test_stratamap.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from memstrata.api.architecture import PRESETS
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.inventory import NodeInventory
from memstrata.api.manifest import load_node
from memstrata.plan import job_shape, plan_job

BASE: dict[str, Any] = {"model": {"preset": "gpt-350m"}, "dataset": {"synthetic": "copy"},
                        "training": {"steps": 10, "sequenceLength": 128}, "resources": {"gpus": 0}}


def _spec(update: str, engine: str = "memstrata", **memory: Any) -> FineTuneJobSpec:
    return FineTuneJobSpec.model_validate({**BASE, "training": {**BASE["training"], "update": update},
                                           "memory": {"engine": engine, **memory}})


@pytest.fixture
def node(repo: Path) -> NodeInventory:
    return load_node(repo / "examples/node-cxl.yaml").model_copy(update={"cxl_nodes": []})


def test_delayed_on_the_stock_engine_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="training.update: delayed needs memory.engine memstrata, not "
                                              "deepspeed"):
        _spec("delayed", "deepspeed")
    with pytest.raises(ValidationError, match="training.update"):
        _spec("later")
    assert _spec("exact", "deepspeed").training.update == "exact"
    assert FineTuneJobSpec.model_validate(BASE).training.update == "exact"


def test_the_plan_counts_a_shadow_of_every_trained_weight_with_the_weights(node: NodeInventory) -> None:
    exact, delayed = plan_job(_spec("exact"), node), plan_job(_spec("delayed"), node)
    trained = PRESETS["gpt-350m"].parameters()
    assert delayed.category("weights").bytes - exact.category("weights").bytes == 2 * trained
    for c in ("gradients", "master", "optimizer"):
        assert delayed.category(c).bytes == exact.category(c).bytes, c
    assert delayed.delayed_update and not exact.delayed_update
    assert job_shape(_spec("delayed")).delayed_update


def test_under_a_tight_budget_the_shadows_push_state_to_nvme(node: NodeInventory) -> None:
    """The same DRAM budget holds 2 B per parameter less of everything else: the shadows are never assumed free."""
    budget = {"dramBudget": "3Gi", "nvmeNamespaces": 1}
    exact, delayed = plan_job(_spec("exact", **budget), node), plan_job(_spec("delayed", **budget), node)
    assert exact.feasible and delayed.feasible
    moved = sum(delayed.category(c).on("nvme") - exact.category(c).on("nvme") for c in ("master", "optimizer",
                                                                                       "weights"))
    assert moved >= 2 * PRESETS["gpt-350m"].parameters() * 0.9, moved



def test_where_the_weights_would_go_to_nvme_the_delayed_update_is_dropped_with_a_note(node: NodeInventory) -> None:
    """The runtime refuses it where the forward reads weights from NVMe, so a plan that counted its shadows there
    would hold 2 B per parameter for nothing: the plan is the exact one, and says why."""
    budget = {"dramBudget": "1Gi", "nvmeNamespaces": 1}
    exact, asked = plan_job(_spec("exact", **budget), node), plan_job(_spec("delayed", **budget), node)
    assert exact.feasible and exact.category("weights").on("nvme") > 0
    assert not asked.delayed_update and asked.categories == exact.categories
    assert asked.notes[0].startswith("training.update delayed dropped: with their shadows the weights do not fit")
    roomy = plan_job(_spec("delayed", dramBudget="3Gi"), node)
    assert roomy.delayed_update and not any("dropped" in n for n in roomy.notes)
