"""Every model family is one module of memstrata.api.families, and the rest of the API asks its registry: a
Gemma config.json reads as a Gemma shape, the CRD offers its family and preset, and the planner counts what
Gemma's norms keep (measured against a real model in tests/runtime/test_family_activations.py)."""
from __future__ import annotations

import pytest

from memstrata.api.architecture import PRESETS, ModelArchitecture
from memstrata.api.crd import generate_crd
from memstrata.api.families import FAMILIES, family_of_model_type
from memstrata.api.hfconfig import architecture_from_config, config_mismatches
from memstrata.api.lora import Lora, adapter_tensor_sizes
from memstrata.plan.accounting import head_input_bytes, layer_activation_bytes

# Gemma-2B's config.json as `transformers` saves it (its tie_word_embeddings default, true, left out).
GEMMA_2B = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_size": 2048,
            "intermediate_size": 16384, "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
            "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
            "hidden_activation": "gelu_pytorch_tanh"}


def test_a_gemma_config_reads_as_the_gemma_family_tied_unless_it_says_otherwise() -> None:
    arch = architecture_from_config(GEMMA_2B)
    assert arch.family == "gemma" and arch.tied and not arch.qkv_bias
    assert arch == PRESETS["gemma-2b"].model_copy(update={"max_positions": 8192})
    assert not architecture_from_config({**GEMMA_2B, "tie_word_embeddings": False}).tied


def test_model_types_no_family_names_are_read_as_llama_as_before() -> None:
    assert family_of_model_type("olmo").name == "llama" and family_of_model_type("phi3").name == "phi3"
    assert family_of_model_type("qwen2").name == "llama" and family_of_model_type("gpt2").name == "gpt"


def test_the_crd_offers_every_registered_family_and_preset() -> None:
    spec = generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    schema = spec["properties"]["model"]
    assert schema["properties"]["architecture"]["properties"]["family"]["enum"] == list(FAMILIES) \
        == ["gpt", "llama", "gemma", "phi3", "qwen3"]
    assert "gemma-2b" in schema["properties"]["preset"]["enum"]


def test_an_unknown_family_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown family 'phi'.*gpt, llama, gemma, phi3, qwen3"):
        ModelArchitecture(family="phi", layers=1, hidden=8, intermediate=8, heads=2, kv_heads=2, vocab=8)


def test_gemma_2b_counts_by_hand() -> None:
    """h 2048, i 16384, 8 heads of 256, one KV head (kv 256), vocab 256000, tied.
    Parameters: 256000·2048 + 18·(2·2048² + 2·2048·256 + 3·2048·16384 + 2·2048) + 2048 = 2,506,172,416.
    A layer in bf16 a token: Gemma's two norms 2·(8h + 4) = 32,776; 4hw = 16,384; 2·kv·w = 1,024; 4n = 32;
    2·(h/n)·w = 1,024; 4iw = 131,072: 182,312 (Llama's norms would keep 2·(4h + 4 + hw) = 24,584: 8,192 less).
    The head's input: (8 + w)·h = 20,480."""
    arch = PRESETS["gemma-2b"]
    assert arch.parameters() == 2_506_172_416
    assert layer_activation_bytes(arch, 2) == 182_312
    as_llama = arch.model_copy(update={"family": "llama"})
    assert layer_activation_bytes(arch, 2) - layer_activation_bytes(as_llama, 2) == 8_192
    assert layer_activation_bytes(arch, 4) == layer_activation_bytes(as_llama, 4), "fp32: no copy to count"
    assert head_input_bytes(arch, 2) == 20_480


def test_gemma_lora_targets_are_its_separate_projections() -> None:
    arch = PRESETS["gemma-2b"]
    assert adapter_tensor_sizes(arch, Lora(rank=8)) == [8 * 2048, 2048 * 8, 8 * 2048, 256 * 8] * 18
    with pytest.raises(ValueError, match="c_attn: not a linear module of a Gemma model's layers"):
        adapter_tensor_sizes(arch, Lora(target_modules=["c_attn"]))


# Gemma-7B's and Mistral-NeMo's config.json (as `transformers` saves them): heads not hidden / heads wide.
GEMMA_7B = {**GEMMA_2B, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256}
MISTRAL_NEMO = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 5120,
                "intermediate_size": 14336, "num_hidden_layers": 40, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072, "max_position_embeddings": 1024000,
                "tie_word_embeddings": False}


@pytest.mark.parametrize(("config", "preset"), [(GEMMA_7B, "gemma-7b"), (MISTRAL_NEMO, "mistral-nemo-12b")])
def test_a_head_width_other_than_hidden_over_heads_is_read_and_counted(config: dict, preset: str) -> None:
    arch = architecture_from_config(config)
    assert arch.head_dim == config["head_dim"] and arch.q_dim == config["head_dim"] * config["num_attention_heads"]
    assert arch == PRESETS[preset].model_copy(update={"max_positions": config["max_position_embeddings"]})


def test_gemma_7b_counts_by_hand() -> None:
    """h 3072, i 24576, 16 heads of 256 (q 4096, kv 4096), vocab 256000, tied. A layer: q and o 2·3072·4096,
    k and v 2·3072·4096, the MLP 3·3072·24576, two norms: 50,331,648 + 226,492,416 + 6,144 = 276,830,208;
    with the embedding 786,432,000 and the final norm, 8,537,680,896 (Gemma-7B's published 8.54B). In bf16 a
    token keeps in a layer: Gemma's norms 2·(8h + 4) = 49,160; 2hw + 2qw = 28,672; 2·kv·w = 16,384; 4n = 64;
    2dw = 1,024; 4iw = 196,608: 291,912 (hidden / heads would have made q 3072: 4,096 less)."""
    arch = PRESETS["gemma-7b"]
    assert arch.parameters() == 8_537_680_896
    assert layer_activation_bytes(arch, 2) == 291_912
    assert adapter_tensor_sizes(arch, Lora(rank=8)) == [8 * 3072, 4096 * 8, 8 * 3072, 4096 * 8] * 28


def test_a_head_width_is_refused_where_the_family_has_none_and_where_it_is_not_a_count() -> None:
    with pytest.raises(ValueError, match="headDim 64: a GPT-2 model's heads are hidden / heads wide"):
        ModelArchitecture(family="gpt", layers=1, hidden=256, intermediate=1024, heads=8, kv_heads=8, vocab=8,
                          head_dim=64)
    with pytest.raises(ValueError, match="config.json: head_dim must be a positive integer, got 'wide'"):
        architecture_from_config({**GEMMA_7B, "head_dim": "wide"})
    with pytest.raises(ValueError, match="hidden .250. must be divisible by heads .8., or headDim given"):
        ModelArchitecture(layers=1, hidden=250, intermediate=1024, heads=8, kv_heads=8, vocab=8)


# Phi-3-mini-4k-instruct's config.json (the fields memstrata reads; its own pad token 32000 and rope settings aside).
PHI3_MINI = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072,
             "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "vocab_size": 32064, "max_position_embeddings": 4096, "tie_word_embeddings": False,
             "attention_bias": False}


def test_phi3_reads_as_its_fused_family_and_lora_targets_its_fused_projections() -> None:
    """Phi-3-mini: 3,821,079,552 parameters (Llama's count of the same shape), in 32 · 6 + 3 tensors: o_proj
    3072², qkv_proj 3·3072², gate_up_proj 2·8192·3072, down_proj 3072·8192, two norms; embedding, norm, head."""
    arch = architecture_from_config(PHI3_MINI)
    assert arch == PRESETS["phi3-mini"].model_copy(update={"max_positions": 4096})
    assert arch.parameters() == 3_821_079_552 == arch.model_copy(update={"family": "llama"}).parameters()
    sizes = arch.tensor_sizes()
    assert len(sizes) == 32 * 6 + 3 and sizes[1:5] == [3072 * 3072, 3 * 3072 * 3072, 2 * 8192 * 3072, 3072 * 8192]
    assert adapter_tensor_sizes(arch, Lora(rank=8)) == [8 * 3072, 3 * 3072 * 8] * 32  # qkv_proj by default
    with pytest.raises(ValueError, match="q_proj: not a linear module of a Phi-3 model's layers"):
        adapter_tensor_sizes(arch, Lora(target_modules=["q_proj"]))


# Qwen3-0.6B's config.json (the fields memstrata reads): 16 heads of 128 at hidden 1024, the head tied.
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
             "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": True,
             "attention_bias": False}


def test_qwen3_reads_as_its_family_with_its_head_norms_counted() -> None:
    """Qwen3-0.6B: 596,049,920 parameters (its published 0.6B; 440,467,456 without the embedding, the published
    0.44B): Llama's count of the shape plus 28 layers' q_norm and k_norm of 128 each (7,168)."""
    arch = architecture_from_config(QWEN3_06B)
    assert arch == PRESETS["qwen3-0.6b"].model_copy(update={"max_positions": 40960})
    assert arch.parameters() == 596_049_920
    assert arch.parameters() - arch.model_copy(update={"family": "llama"}).parameters() == 28 * 2 * 128
    assert arch.tensor_sizes()[1:10] == [2048 * 1024, 1024 * 1024, 1024 * 1024, 1024 * 2048, 128, 128,
                                         3072 * 1024, 3072 * 1024, 1024 * 3072]


@pytest.mark.parametrize(("model_type", "key"), [("mixtral", "num_local_experts"), ("qwen3_moe", "num_experts"),
                                                 ("deepseek_v3", "n_routed_experts")])
def test_a_mixture_of_experts_is_refused_naming_the_field(model_type: str, key: str) -> None:
    """Read as Llama-shaped, a mixture of experts would be planned with one expert a layer: a fraction of its
    memory, and an OOM kill at the first step. It is refused with the field that says so."""
    config = {**MISTRAL_NEMO, "model_type": model_type, key: 8, "architectures": ["XForCausalLM"]}
    with pytest.raises(ValueError, match=f"config.json: {key} 8: a mixture-of-experts model .{model_type}."):
        architecture_from_config(config)
    assert architecture_from_config({**MISTRAL_NEMO, "num_local_experts": 1}).family == "llama", "one expert: dense"


def test_a_declared_head_width_is_compared_by_width_and_a_missing_one_is_the_config_classes() -> None:
    """A job may declare headDim as config.json says it, also where it is hidden / heads (Llama-3-8B's 128); a
    config.json without head_dim gets the width transformers' config class assumes (Qwen3 128, Gemma 256)."""
    found = architecture_from_config({**MISTRAL_NEMO, "head_dim": 160})  # 5120 / 32: no explicit width
    assert found.head_dim is None and config_mismatches(found.model_copy(update={"head_dim": 160}), found) == []
    assert config_mismatches(found.model_copy(update={"head_dim": 128}), found) == [
        "architecture.headDim: the job declares 128, the model directory has 160"]
    no_width = {k: v for k, v in QWEN3_06B.items() if k != "head_dim"}
    assert architecture_from_config(no_width).head_width == 128
    assert architecture_from_config({k: v for k, v in GEMMA_7B.items() if k != "head_dim"}).head_width == 256
    with pytest.raises(ValueError, match="config.json: attention_bias true: a Qwen3 with biased projections"):
        architecture_from_config({**QWEN3_06B, "attention_bias": True})


def test_the_largest_tensor_is_the_layouts_a_fused_one_included() -> None:
    """Phi-3-medium (h 5120, i 17920, vocab 32064): its gate_up_proj, 2·17920·5120 = 183,500,800 elements, is
    larger than the embedding (164,167,680): the stock engine's parameter buffers and the planner's build
    transient are sized by it."""
    medium = PRESETS["phi3-mini"].model_copy(update={"layers": 40, "hidden": 5120, "intermediate": 17920,
                                                     "heads": 40, "kv_heads": 10})
    assert medium.largest_tensor() == 2 * 17920 * 5120 == max(medium.tensor_sizes())
    for name in ("gpt-125m", "llama3-8b", "gemma-7b"):  # the embedding, as before
        assert PRESETS[name].largest_tensor() == PRESETS[name].vocab * PRESETS[name].hidden
