"""A family's activation formula against the model `transformers` builds: torch's saved-tensor hooks count what
one layer and the final norm keep for backward, per token (the slope between two sequence lengths, so tensors
that do not grow with the tokens, such as Gemma's (1 + weight), drop out). Gemma's norms keep fp32 copies that
Llama's do not: the measured difference between the two families on one shape is the formulas' difference."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")

from torch.autograd.graph import saved_tensors_hooks  # noqa: E402

from memstrata.api.architecture import ModelArchitecture  # noqa: E402
from memstrata.plan.accounting import head_input_bytes, layer_activation_bytes  # noqa: E402
from memstrata.runtime.train.model.hfmodel import random_model  # noqa: E402


def _shape(family: str) -> ModelArchitecture:
    return ModelArchitecture(family=family, layers=2, hidden=256, intermediate=640, heads=8, kv_heads=2, vocab=256,
                             tied=True)


def _saved(model: torch.nn.Module, module: torch.nn.Module, tokens: int) -> int:
    """Bytes `module` saves for backward in a training forward of `tokens` tokens (parameters and views of one
    tensor counted once; the parameters themselves are not activations)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[tuple[int, torch.dtype, tuple[int, ...], int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[(t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape), t.storage_offset())] = \
                t.numel() * t.element_size()
        return t

    hooks = saved_tensors_hooks(pack, lambda t: t)
    before = module.register_forward_pre_hook(lambda *_: hooks.__enter__())
    after = module.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    x = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    model(input_ids=x, labels=x).loss
    before.remove()
    after.remove()
    return sum(seen.values())


def _per_token(family: str, dtype: torch.dtype) -> tuple[int, int]:
    model = random_model(_shape(family), 128, seed=0).to(dtype)
    layer, norm = model.model.layers[1], model.model.norm
    layer_slope = (_saved(model, layer, 96) - _saved(model, layer, 32)) // 64
    norm_slope = (_saved(model, norm, 96) - _saved(model, norm, 32)) // 64
    return layer_slope, norm_slope


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gemma_keeps_what_its_formula_adds_to_llamas(dtype: torch.dtype) -> None:
    w = 2 if dtype == torch.bfloat16 else 4
    gemma, llama = _per_token("gemma", dtype), _per_token("llama", dtype)
    arch, as_llama = _shape("gemma"), _shape("llama")
    assert gemma[0] - llama[0] == layer_activation_bytes(arch, w) - layer_activation_bytes(as_llama, w)
    # The final norm: the head's input, the same in both, is outside it.
    assert gemma[1] - llama[1] == head_input_bytes(arch, w) - head_input_bytes(as_llama, w)
    if w == 2:
        assert gemma[0] - llama[0] == 2 * 2 * 256, "two norms' fp32 normalized outputs instead of bf16 ones"
