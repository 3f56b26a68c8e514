"""Model shapes: the built-in presets and the inline architecture of a local model.

The planner needs only shapes, never weights, so the operator can plan a job
whose model directory sits on a volume it cannot read.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from memstrata.api.base import ApiModel

Family = Literal["gpt", "llama"]


class ModelArchitecture(ApiModel):
    """The shape of a decoder-only transformer.

    `gpt`: GPT-2 style — learned positions, LayerNorm with bias, biased
    projections, a 2-matrix GELU MLP. `llama`: RMSNorm, rotary positions,
    a 3-matrix SwiGLU MLP, no biases (except Q/K/V when `qkvBias`, as in Qwen2).
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
    max_positions: int = Field(2048, gt=0, description="Learned position table length (gpt family).")

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelArchitecture":
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kvHeads ({self.kv_heads})")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.kv_heads

    def embedding_params(self) -> int:
        pos = self.max_positions * self.hidden if self.family == "gpt" else 0
        return self.vocab * self.hidden + pos

    def attention_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        weights = h * h + 2 * h * kv + h * h  # q, k, v, o
        if self.family == "gpt":
            return weights + h + 2 * kv + h
        return weights + ((h + 2 * kv) if self.qkv_bias else 0)

    def mlp_params(self) -> int:
        h, i = self.hidden, self.intermediate
        if self.family == "gpt":
            return 2 * h * i + i + h
        return 3 * h * i

    def norm_params(self) -> int:
        """One norm's parameters (LayerNorm has a bias, RMSNorm does not)."""
        return 2 * self.hidden if self.family == "gpt" else self.hidden

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

    def largest_tensor(self) -> int:
        """Elements of the largest single parameter (the embedding or LM head here)."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)


def _gpt(layers: int, hidden: int, heads: int, vocab: int = 50304, positions: int = 2048) -> ModelArchitecture:
    return ModelArchitecture(
        family="gpt", layers=layers, hidden=hidden, intermediate=4 * hidden, heads=heads,
        kv_heads=heads, vocab=vocab, tied=True, max_positions=positions,
    )


PRESETS: dict[str, ModelArchitecture] = {
    # Small enough to fine-tune on a 2-core CPU with NVMe offload in minutes.
    "gpt-tiny": _gpt(layers=2, hidden=128, heads=4, vocab=512, positions=512),
    "gpt-125m": _gpt(layers=12, hidden=768, heads=12),
    "gpt-350m": _gpt(layers=24, hidden=1024, heads=16),
    # Shapes only: for planning real jobs (random weights build too: the long-context benchmark on a GPU).
    "llama3.2-1b": ModelArchitecture(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256,
                                     tied=True),
    "llama3-8b": ModelArchitecture(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256),
    "llama3-70b": ModelArchitecture(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=128256),
    "qwen2.5-14b": ModelArchitecture(
        layers=48, hidden=5120, intermediate=13824, heads=40, kv_heads=8, vocab=152064, qkv_bias=True
    ),
    "mistral-7b": ModelArchitecture(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000),
}

PresetName = Literal["gpt-tiny", "gpt-125m", "gpt-350m", "llama3.2-1b", "llama3-8b", "llama3-70b", "qwen2.5-14b", "mistral-7b"]
