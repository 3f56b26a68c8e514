"""With weight decay, the optimizer decays the weight matrices and embeddings only: biases and norm scales go in a
group of their own at 0, as transformers' Trainer and TRL group them; without decay it gets one group, the
layout earlier checkpoints have. The split holds on ZeRO-3's partitioned parameters, whose own tensors are
empty."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")
pytest.importorskip("transformers", reason="transformers is not installed: run `make install`")

from memstrata.api.architecture import PRESETS  # noqa: E402
from memstrata.runtime.train.building import param_groups  # noqa: E402
from memstrata.runtime.train.model.hfmodel import random_model  # noqa: E402


def _names(model, params) -> set[str]:  # type: ignore[no-untyped-def]
    named = {id(p): n for n, p in model.named_parameters()}
    return {named[id(p)] for p in params}


def test_biases_and_norm_scales_are_not_decayed() -> None:
    model = random_model(PRESETS["gpt-tiny"], 32, 1234)
    flat = {n for n, _ in model.named_parameters()
            if n.endswith(".bias") or ".ln_" in n or n.startswith("transformer.ln_f")}
    assert flat and any(n.endswith(".weight") and ".ln_" in n for n in flat)  # the norms' scales, not only biases
    decayed, kept = param_groups(model, 0.1)
    assert kept["weight_decay"] == 0.0 and "weight_decay" not in decayed  # the rest decay at the configured rate
    assert _names(model, kept["params"]) == flat
    assert _names(model, decayed["params"]) == {n for n, _ in model.named_parameters()} - flat
    assert param_groups(model, 0.0) == list(model.parameters())  # no decay: one group, as before

    # As ZeRO-3 leaves them after zero.Init: each parameter's tensor empty, its shape kept in ds_shape.
    for p in model.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    decayed, kept = param_groups(model, 0.1)
    assert _names(model, kept["params"]) == flat
