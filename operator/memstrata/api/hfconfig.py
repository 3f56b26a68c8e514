"""A Hugging Face `config.json` read as a planning shape (`ModelArchitecture`), and the check that a job's
declared architecture matches the directory's.

Pure: a dict in, a shape or a `ModelConfigError` out. The operator's inspection pod, `memstrata run` and the
runtime all read a model directory's shape through here, so they can never disagree about it. Field names
follow `transformers`' `PretrainedConfig` attribute map: most causal LMs use the Llama names
(`num_hidden_layers`, `hidden_size`, ...), GPT-2 its own (`n_layer`, `n_embd`, ...). The `model_type` picks the
family (memstrata.api.families), which says what the config leaves unsaid.
"""
from __future__ import annotations

from typing import Any

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.families import family_of_model_type

__all__ = ["ModelConfigError", "architecture_from_config", "config_mismatches"]

# The model classes `transformers` names causal LMs with (`architectures` in config.json, when it is there).
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")

_NAMES = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "vocab": ("vocab_size",),
    "max_positions": ("max_position_embeddings", "n_positions", "n_ctx"),
    "head_dim": ("head_dim",),
}


# How transformers' configs count a mixture of experts' experts (Mixtral, Qwen2/3-MoE and OLMoE, DeepSeek, ERNIE).
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


class ModelConfigError(ValueError):
    """A model's config.json cannot be read as a causal LM shape; the message names the file and the field."""


def _int(config: dict[str, Any], source: str, field: str, *, required: bool = True) -> int | None:
    for name in _NAMES[field]:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelConfigError(f"{source}: {name} must be a positive integer, got {value!r}")
        return value
    if required:
        raise ModelConfigError(f"{source}: no {' or '.join(_NAMES[field])}: not a decoder-only transformer "
                               "config that memstrata can plan")
    return None


def architecture_from_config(config: dict[str, Any], source: str = "config.json") -> ModelArchitecture:
    """The shape `config` (a parsed config.json) describes; `source` names the file in errors."""
    if not isinstance(config, dict):
        raise ModelConfigError(f"{source}: expected a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelConfigError(f"{source}: no model_type: not a Hugging Face model config")
    classes = config.get("architectures")
    if isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes) \
            and not any(c.endswith(CAUSAL_LM_SUFFIXES) for c in classes):
        raise ModelConfigError(f"{source}: architectures {classes}: not a causal language model (memstrata "
                               f"fine-tunes a *{' or *'.join(CAUSAL_LM_SUFFIXES)} model)")
    for key in EXPERT_COUNTS:
        experts = config.get(key)
        if isinstance(experts, int) and not isinstance(experts, bool) and experts > 1:
            raise ModelConfigError(f"{source}: {key} {experts}: a mixture-of-experts model ({model_type}); memstrata "
                                   "plans dense decoder-only models only, and would count one expert of each layer")
    fam = family_of_model_type(model_type)
    hidden = _int(config, source, "hidden")
    heads = _int(config, source, "heads")
    assert hidden is not None and heads is not None
    ratio = fam.default_intermediate_ratio
    intermediate = _int(config, source, "intermediate", required=ratio is None) or (ratio or 0) * hidden
    kv_heads = _int(config, source, "kv_heads", required=False) or heads
    positions = _int(config, source, "max_positions", required=False) or 2048
    head_dim = _int(config, source, "head_dim", required=False) or fam.default_head_dim
    if head_dim is not None and head_dim * heads == hidden:
        head_dim = None  # the width every family assumes: a shape says it only where it differs
    if head_dim is not None and not fam.free_head_dim:
        raise ModelConfigError(f"{source}: head_dim {head_dim} is not hidden_size / num_attention_heads "
                               f"({hidden} / {heads}), which a {fam.title} model's heads always are")
    try:
        return ModelArchitecture(
            family=fam.name,
            layers=_int(config, source, "layers"), hidden=hidden, intermediate=intermediate, heads=heads,
            kv_heads=kv_heads, vocab=_int(config, source, "vocab"),
            tied=bool(config.get("tie_word_embeddings", fam.tied_by_default)),
            qkv_bias=fam.qkv_bias(model_type, config), max_positions=positions, head_dim=head_dim,
        )
    except ValueError as exc:
        raise ModelConfigError(f"{source}: {exc}") from None


def config_mismatches(declared: ModelArchitecture, found: ModelArchitecture) -> list[str]:
    """Each field where a job's declared architecture differs from the directory's, with both values."""
    fields = ["family", "layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "tied", "qkv_bias",
              "head_dim"]
    if found.spec.learned_positions:
        fields.append("max_positions")
    out = []
    for name in fields:
        # A headDim of hidden / heads, declared or not, is the same width.
        attr = "head_width" if name == "head_dim" else name
        a, b = getattr(declared, attr), getattr(found, attr)
        if a != b:
            alias = ModelArchitecture.model_fields[name].alias or name
            out.append(f"architecture.{alias}: the job declares {a!r}, the model directory has {b!r}")
    return out
