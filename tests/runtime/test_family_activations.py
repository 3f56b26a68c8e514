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


def _shape(family: str, head_dim: int | None = None) -> ModelArchitecture:
    return ModelArchitecture(family=family, layers=2, hidden=256, intermediate=640, heads=8, kv_heads=2, vocab=256,
                             tied=True, head_dim=head_dim)


def _saved(model: torch.nn.Module, module: torch.nn.Module, tokens: int) -> int:
    """Bytes `module` saves for backward in a training forward of `tokens` tokens: each storage once, whatever
    views of it are saved (sdpa's output and o_proj's input are one tensor in two shapes); the parameters
    themselves are not activations."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    hooks = saved_tensors_hooks(pack, lambda t: t)
    before = module.register_forward_pre_hook(lambda *_: hooks.__enter__())
    after = module.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))
    x = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    model(input_ids=x, labels=x).loss
    before.remove()
    after.remove()
    return sum(seen.values())


def _per_token(family: str, dtype: torch.dtype, head_dim: int | None = None) -> tuple[int, int]:
    model = random_model(_shape(family, head_dim), 128, seed=0).to(dtype)
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


@pytest.mark.parametrize("head_dim", [16, 64], ids=["narrower", "wider"])
def test_heads_not_hidden_over_heads_wide_keep_what_the_formula_says(head_dim: int) -> None:
    """Mistral-NeMo's heads are narrower than hidden / heads, Gemma-7B's wider: the queries, keys, values, the
    attention output o_proj keeps and the rotary tables change width, the rest does not (bf16; 8 heads at hidden
    256 are 32 wide). At one sequence a layer keeps exactly what the formula says, both ways."""
    wide, plain = _per_token("llama", torch.bfloat16, head_dim), _per_token("llama", torch.bfloat16)
    arch, default = _shape("llama", head_dim), _shape("llama")
    assert (wide[0], plain[0]) == (layer_activation_bytes(arch, 2), layer_activation_bytes(default, 2))
    assert wide[0] != plain[0] and wide[1] == plain[1], "the final norm keeps what it did"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_phi3s_fused_projections_keep_what_its_formula_says(dtype: torch.dtype) -> None:
    """Phi-3 fuses q/k/v and gate/up into single tensors: the value sdpa keeps is a view of the whole fused output,
    and its attention output is kept beside o_proj's copy. A layer of the real model, per token, is the formula."""
    w = 2 if dtype == torch.bfloat16 else 4
    phi3, llama = _per_token("phi3", dtype), _per_token("llama", dtype)
    assert phi3[0] == layer_activation_bytes(_shape("phi3"), w)
    assert phi3[0] - llama[0] == (2 * 256 + 64) * w, "(q + kv)·w of the fused qkv output and o_proj's copy (qw)"
    assert phi3[1] == llama[1], "the final norm is Llama's"


@pytest.mark.parametrize("head_dim", [None, 64], ids=["plain", "wider"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_qwen3s_head_norms_keep_what_its_formula_adds(dtype: torch.dtype, head_dim: int | None) -> None:
    """Qwen3 normalizes every query and key head before the rotary positions: a layer of the real model keeps
    Llama's bytes and those two norms', per token, exactly as the formula says."""
    w = 2 if dtype == torch.bfloat16 else 4
    qwen3, llama = _per_token("qwen3", dtype, head_dim), _per_token("llama", dtype, head_dim)
    arch = _shape("qwen3", head_dim)
    assert qwen3[0] == layer_activation_bytes(arch, w)
    assert qwen3[0] - llama[0] == (4 + w) * (arch.q_dim + arch.kv_dim) + 4 * (8 + 2)
    assert qwen3[1] == llama[1]
