"""Model shapes: the built-in presets and the inline architecture of a local model.

The planner needs only shapes, never weights, so the operator can plan a job
whose model directory sits on a volume it cannot read.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, Field, WithJsonSchema, model_validator

from memstrata.api.base import ApiModel
from memstrata.api.families import FAMILIES, ModelFamily, family


def _one_of(known: Mapping[str, Any], what: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value not in known:
            raise ValueError(f"unknown {what} {value!r} (known: {', '.join(known)})")
        return value
    return check


# A family's name: one of the registry's (memstrata.api.families), which the CRD's enum lists.
Family = Annotated[str, AfterValidator(_one_of(FAMILIES, "family")),
                   WithJsonSchema({"enum": list(FAMILIES), "type": "string"})]


class ModelArchitecture(ApiModel):
    """The shape of a decoder-only transformer of a family, which counts its parts: `gpt` (GPT-2 style — learned
    positions, LayerNorm with bias, biased projections, a 2-matrix GELU MLP), `llama` (RMSNorm, rotary positions,
    a 3-matrix SwiGLU MLP, no biases except Q/K/V when `qkvBias`, as in Qwen2) or another of
    memstrata.api.families.
    """

    family: Family = "llama"
    layers: int = Field(gt=0, description="Number of transformer blocks.")
    hidden: int = Field(gt=0, description="Model width (d_model).")
    intermediate: int = Field(gt=0, description="MLP inner width.")
    heads: int = Field(gt=0, description="Attention (query) heads.")
    kv_heads: int = Field(gt=0, description="Key/value heads (grouped-query attention).")
    vocab: int = Field(gt=0, description="Vocabulary size.")
    tied: bool = Field(False, description="LM head shares the input embedding.")
    qkv_bias: bool = Field(False, description="Q/K/V projections carry a bias (Qwen2).")
    head_dim: int | None = Field(None, gt=0, description=(
        "Width of one attention head where it is not hidden / heads (config.json's head_dim: Gemma-7B's 256 at "
        "hidden 3072 and 16 heads, Mistral-NeMo's 128 at 5120 and 32); omitted: hidden / heads."))
    max_positions: int = Field(2048, gt=0, description="Learned position table length (gpt family).")

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelArchitecture":
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads}), or headDim given")
        if self.head_dim is not None and self.head_dim * self.heads != self.hidden and not self.spec.free_head_dim:
            raise ValueError(f"headDim {self.head_dim}: a {self.spec.title} model's heads are hidden / heads wide "
                             f"({self.hidden} / {self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kvHeads ({self.kv_heads})")
        return self

    @property
    def head_width(self) -> int:
        """One attention head's width: headDim where given, else hidden / heads."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """The queries' width (and the attention output's, which o_proj reads): hidden unless headDim says."""
        return self.head_width * self.heads

    @property
    def kv_dim(self) -> int:
        return self.head_width * self.kv_heads

    @property
    def spec(self) -> ModelFamily:
        """What the family says of models of this shape."""
        return family(self.family)

    def embedding_params(self) -> int:
        return self.spec.embedding_params(self)

    def attention_params(self) -> int:
        return self.spec.attention_params(self)

    def mlp_params(self) -> int:
        return self.spec.mlp_params(self)

    def norm_params(self) -> int:
        """One norm's parameters (LayerNorm has a bias, RMSNorm does not)."""
        return self.spec.norm_params(self)

    def layer_params(self) -> int:
        return self.attention_params() + self.mlp_params() + 2 * self.norm_params()

    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def parameters(self) -> int:
        """Total trainable parameters."""
        return (
            self.embedding_params()
            + self.layers * self.layer_params()
            + self.norm_params()
            + self.head_params()
        )

    def tensor_sizes(self) -> list[int]:
        """Elements of every parameter tensor of the `transformers` model of this shape, in `model.parameters()`
        order (shared tensors once): the planner's layout, which the memstrata engine's sub-groups follow."""
        return self.spec.tensor_sizes(self)

    def largest_tensor(self) -> int:
        """Elements of the largest single parameter tensor, by its family's layout (the embedding or LM head, an
        MLP matrix, or a fused one: Phi-3's gate_up_proj is 2·intermediate·hidden)."""
        return max(self.tensor_sizes())


def _presets() -> dict[str, ModelArchitecture]:
    return {name: ModelArchitecture(family=f.name, **fields) for f in FAMILIES.values()
            for name, fields in f.presets.items()}


# Every family's presets, in the registry's order.
PRESETS: dict[str, ModelArchitecture] = _presets()
# A preset's name: one of PRESETS, which the CRD's enum lists.
PresetName = Annotated[str, AfterValidator(_one_of(PRESETS, "preset")),
                       WithJsonSchema({"enum": list(PRESETS), "type": "string"})]
