"""What memstrata needs of a model family, in one place: `ModelFamily`, which each family module subclasses.

A family is a kind of decoder-only transformer that `transformers` builds (GPT-2's blocks, Llama's, Gemma's):
how its shape is read from a Hugging Face config, how many parameters each part has and in what tensors (the
planner's layout, which the memstrata engine's sub-groups follow), which linear modules LoRA may target, its
presets, the bytes a layer and the LM head keep for backward, and the `transformers` config a preset becomes.
Pure arithmetic and data (no torch), so the operator can plan with it; the runtime reads the same declarations.
"""
from __future__ import annotations

from typing import Any, ClassVar, Protocol

__all__ = ["ModelFamily", "Linear", "Shape"]


class Shape(Protocol):
    """What a family reads of a model's shape (memstrata.api.architecture.ModelArchitecture has it all): typed
    here, so that the architecture, which asks the families, is not imported back."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    qkv_bias: bool
    max_positions: int

    @property
    def head_width(self) -> int: ...

    @property
    def q_dim(self) -> int: ...

    @property
    def kv_dim(self) -> int: ...

    def largest_tensor(self) -> int: ...

Linear = tuple[str, int, int]  # (module name, in_features, out_features)


class ModelFamily:
    """One family's declarations. Subclasses set the class attributes and override what differs; one instance
    per family sits in the registry (memstrata.api.families.FAMILIES), keyed by `name`."""

    name: ClassVar[str]
    title: ClassVar[str]  # how messages name a model of the family
    # Hugging Face `model_type`s read as this family (config.json's own word for its class).
    model_types: ClassVar[frozenset[str]]
    # Model types with a bias on Q/K/V only, whatever their config says about `attention_bias`.
    qkv_bias_model_types: ClassVar[frozenset[str]] = frozenset()
    # What `tie_word_embeddings` is when config.json does not say (transformers omits its class's default).
    tied_by_default: ClassVar[bool] = False
    # The MLP width when config.json has none, as a multiple of hidden (None: it must say).
    default_intermediate_ratio: ClassVar[int | None] = None
    # A learned position table of max_positions rows: the sequence length may not exceed it.
    learned_positions: ClassVar[bool] = False
    # PEFT's own default targets for the family (peft.utils.constants).
    lora_defaults: ClassVar[tuple[str, ...]]
    # The linear modules store their weight transposed (GPT-2's Conv1D): PEFT must be told.
    lora_fan_in_fan_out: ClassVar[bool] = False
    # The input embedding's module name, which training.lora.modulesToSave may name beside `lm_head`.
    embedding_module: ClassVar[str] = "embed_tokens"
    # Its heads may be wider or narrower than hidden / heads (config.json's head_dim); else they are exactly that.
    free_head_dim: ClassVar[bool] = False
    # The head width transformers' config class assumes where config.json has no head_dim (None: hidden / heads).
    default_head_dim: ClassVar[int | None] = None
    # Preset name -> ModelArchitecture fields (family aside): shapes the CRD offers as spec.model.preset.
    presets: ClassVar[dict[str, dict[str, Any]]] = {}

    # --- shape from a config ---------------------------------------------------------------------------------
    def qkv_bias(self, model_type: str, config: dict[str, Any]) -> bool:
        """Whether a config's Q/K/V projections carry biases."""
        return model_type in self.qkv_bias_model_types or bool(config.get("attention_bias", False))

    # --- parameters ------------------------------------------------------------------------------------------
    def embedding_params(self, arch: Shape) -> int:
        return arch.vocab * arch.hidden

    def attention_params(self, arch: Shape) -> int:
        h, q, kv = arch.hidden, arch.q_dim, arch.kv_dim
        return 2 * h * q + 2 * h * kv + ((q + 2 * kv) if arch.qkv_bias else 0)

    def mlp_params(self, arch: Shape) -> int:
        return 3 * arch.hidden * arch.intermediate

    def norm_params(self, arch: Shape) -> int:
        """One norm's parameters."""
        return arch.hidden

    def largest_param(self, arch: Shape) -> int:
        """Elements of the largest parameter tensor (embedding/head, MLP matrix or position table)."""
        return arch.largest_tensor()

    def tensor_sizes(self, arch: Shape) -> list[int]:
        """Elements of every parameter tensor of the `transformers` model for `arch`, in `model.parameters()`
        order (shared tensors once): the planner's layout, which the memstrata engine's sub-groups follow."""
        raise NotImplementedError

    # --- LoRA ------------------------------------------------------------------------------------------------
    def layer_linears(self, arch: Shape) -> list[Linear]:
        """(name, in_features, out_features) of one transformer layer's linear modules, in `model.parameters()`
        order: the modules LoRA may target."""
        raise NotImplementedError

    # --- activations -----------------------------------------------------------------------------------------
    def layer_activation_bytes(self, arch: Shape, w: int) -> int:
        """Bytes one transformer layer saves for backward per token, in a training precision of w bytes, as
        `transformers`' layers with sdpa attention save them."""
        raise NotImplementedError

    def head_input_bytes(self, arch: Shape, w: int) -> int:
        """Bytes per token the final norm and the LM head keep of the last hidden state."""
        raise NotImplementedError

    # --- the runtime's model ---------------------------------------------------------------------------------
    def preset_config(self, arch: Shape, sequence_length: int) -> tuple[str, dict[str, Any]]:
        """The `transformers` model type and config arguments of a model of shape `arch` (random weights are
        drawn at build time): what `AutoConfig.for_model` takes. No token id is special to a preset."""
        raise NotImplementedError


# A preset has no tokenizer of its own (it trains on bytes or synthetic data), so no token id is special to it.
NO_SPECIAL_TOKENS: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
