"""A preset becomes a `transformers` model with exactly the parameters the planner counts, and its config reads
back as the same shape: one model path for presets and Hugging Face directories."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")

from memstrata.api.architecture import PRESETS, ModelArchitecture  # noqa: E402
from memstrata.api.hfconfig import architecture_from_config, config_mismatches  # noqa: E402
from memstrata.plan.stock import largest_param, param_tensors  # noqa: E402
from memstrata.runtime.train.model.hfmodel import random_model  # noqa: E402

SHAPES = {
    "gpt-tiny": PRESETS["gpt-tiny"],
    "gpt-untied": ModelArchitecture(family="gpt", layers=3, hidden=96, intermediate=200, heads=6, kv_heads=6,
                                    vocab=300, tied=False, max_positions=64),
    # Llama-3's proportions (GQA 4:1, SwiGLU, untied head), shrunk.
    "llama-gqa": ModelArchitecture(family="llama", layers=3, hidden=128, intermediate=448, heads=8, kv_heads=2,
                                   vocab=320),
    # Qwen2-style Q/K/V biases, tied head, no GQA.
    "qwen2-qkv-bias-tied": ModelArchitecture(family="llama", layers=2, hidden=64, intermediate=160, heads=4,
                                             kv_heads=4, vocab=300, tied=True, qkv_bias=True),
    # Gemma: Llama's layout, multi-query attention, a tied head.
    "gemma-mqa": ModelArchitecture(family="gemma", layers=2, hidden=64, intermediate=192, heads=4, kv_heads=1,
                                   vocab=300, tied=True),
}


def _unique(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list({id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("name", SHAPES)
def test_parameter_count_matches_planner(name: str) -> None:
    arch = SHAPES[name]
    model = random_model(arch, 64, seed=0)
    params = _unique(model)
    assert sum(p.numel() for p in params) == arch.parameters()
    assert len(params) == param_tensors(arch), "dsconfig sizes swap buffers by this count"
    assert max(p.numel() for p in params) == largest_param(arch), "dsconfig sizes buffer_size by this"


@pytest.mark.parametrize("name", SHAPES)
def test_preset_config_reads_back_as_the_same_shape(name: str) -> None:
    arch = SHAPES[name]
    config = random_model(arch, 64, seed=0).config.to_dict()
    assert config_mismatches(arch, architecture_from_config(config)) == []


def test_family_decides_the_transformers_class() -> None:
    kinds = {name: type(random_model(arch, 64, seed=0)).__name__ for name, arch in SHAPES.items()}
    assert kinds == {"gpt-tiny": "GPT2LMHeadModel", "gpt-untied": "GPT2LMHeadModel",
                     "llama-gqa": "LlamaForCausalLM", "qwen2-qkv-bias-tied": "Qwen2ForCausalLM",
                     "gemma-mqa": "GemmaForCausalLM"}


def test_gpt_125m_matches_planner_exactly() -> None:
    """125,262,336 = 50304*768 + 2048*768 + 12*(4*768^2+4*768 + 2*768*3072+3072+768 + 4*768) + 2*768 (tied head)."""
    arch = PRESETS["gpt-125m"]
    assert arch.parameters() == 125_262_336
    with torch.device("meta"):
        model = random_model(arch, 2048, seed=0)
    assert sum(p.numel() for p in _unique(model)) == 125_262_336


@pytest.mark.parametrize("name", SHAPES)
def test_untrained_loss_is_near_uniform(name: str) -> None:
    arch = SHAPES[name]
    model = random_model(arch, 64, seed=0)
    ids = torch.randint(0, arch.vocab, (2, 16))
    out = model(input_ids=ids, labels=torch.randint(0, arch.vocab, (2, 16)))
    assert out.logits.shape == (2, 16, arch.vocab)
    # At initialisation the prediction is close to uniform: loss near ln(vocab).
    assert abs(out.loss.item() - torch.log(torch.tensor(float(arch.vocab))).item()) < 0.5


def test_seeded_initialisation_is_reproducible() -> None:
    a, b = random_model(PRESETS["gpt-tiny"], 64, seed=5), random_model(PRESETS["gpt-tiny"], 64, seed=5)
    c = random_model(PRESETS["gpt-tiny"], 64, seed=6)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
