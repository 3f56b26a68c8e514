"""The torch model has exactly the parameters the planner counts: this ties the run to the plan."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")

from memstrata.api.architecture import PRESETS, ModelArchitecture  # noqa: E402
from memstrata.plan.stock import largest_param, param_tensors  # noqa: E402
from memstrata.runtime.train.model import build_model, count_parameters, largest_parameter  # noqa: E402

SHAPES = {
    "gpt-tiny": PRESETS["gpt-tiny"],
    "gpt-untied": ModelArchitecture(family="gpt", layers=3, hidden=96, intermediate=200, heads=6, kv_heads=6,
                                    vocab=300, tied=False, max_positions=64),
    # Llama-3's proportions (GQA 4:1, SwiGLU, untied head), shrunk.
    "llama-gqa": ModelArchitecture(family="llama", layers=3, hidden=128, intermediate=448, heads=8, kv_heads=2,
                                   vocab=320),
    # Qwen2-style Q/K/V biases, tied head, no GQA.
    "llama-qkv-bias-tied": ModelArchitecture(family="llama", layers=2, hidden=64, intermediate=160, heads=4,
                                             kv_heads=4, vocab=300, tied=True, qkv_bias=True),
}


@pytest.mark.parametrize("name", SHAPES)
def test_parameter_count_matches_planner(name: str) -> None:
    arch = SHAPES[name]
    model = build_model(arch, seed=0)
    assert count_parameters(model) == arch.parameters()
    assert len(list(model.parameters())) == param_tensors(arch), "dsconfig sizes swap buffers by this count"
    assert largest_parameter(model) == largest_param(arch), "dsconfig sizes buffer_size by this"


def test_gpt_125m_matches_planner_exactly() -> None:
    """125,262,336 = 50304*768 + 2048*768 + 12*(4*768^2+4*768 + 2*768*3072+3072+768 + 4*768) + 2*768 (tied head)."""
    arch = PRESETS["gpt-125m"]
    assert arch.parameters() == 125_262_336
    assert count_parameters(build_model(arch, seed=0)) == 125_262_336


@pytest.mark.parametrize("name", SHAPES)
def test_forward_gives_logits_and_a_finite_loss(name: str) -> None:
    arch = SHAPES[name]
    model = build_model(arch, seed=0)
    ids = torch.randint(0, arch.vocab, (2, 16))
    assert model(ids).shape == (2, 16, arch.vocab)
    # Labels independent of the inputs: a tied head favours the input token itself.
    loss = model(ids, torch.randint(0, arch.vocab, (2, 16)))
    # At initialisation the prediction is close to uniform: loss near ln(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(float(arch.vocab))).item()) < 0.5


def test_tied_head_is_one_parameter() -> None:
    model = build_model(PRESETS["gpt-tiny"], seed=0)
    assert model.head.weight is model.embed.weight


def test_causal_no_peeking() -> None:
    """Changing a later token never changes an earlier position's logits."""
    for arch in SHAPES.values():
        model = build_model(arch, seed=1).eval()
        ids = torch.randint(0, arch.vocab, (1, 12))
        other = ids.clone()
        other[0, 8:] = (other[0, 8:] + 1) % arch.vocab
        with torch.no_grad():
            assert torch.allclose(model(ids)[0, :8], model(other)[0, :8], atol=1e-5)


def test_seeded_initialisation_is_reproducible() -> None:
    a, b = build_model(PRESETS["gpt-tiny"], seed=5), build_model(PRESETS["gpt-tiny"], seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
