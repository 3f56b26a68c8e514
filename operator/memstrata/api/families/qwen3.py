"""Qwen3's blocks (the dense models, `model_type: qwen3`): Llama's (q/k/v/o, grouped-query attention, a SwiGLU
MLP, two RMSNorms a layer), no Q/K/V biases, and an RMSNorm over each query and key head (`q_norm`, `k_norm`,
one head wide) before the rotary positions. Its heads are often wider than hidden / heads (Qwen3-0.6B: 16 of 128
at hidden 1024). What differs for memstrata is the two norms' weights and the bytes they keep for backward."""
from __future__ import annotations

from typing import Any

from memstrata.api.families.base import Shape
from memstrata.api.families.llama import Llama


class Qwen3(Llama):
    name = "qwen3"
    title = "Qwen3"
    model_types = frozenset({"qwen3"})
    qkv_bias_model_types = frozenset()
    default_head_dim = 128  # Qwen3Config's
    presets = {
        # Shapes only, for planning: Qwen3-0.6B (tied, heads wider than hidden / heads) and Qwen3-8B.
        "qwen3-0.6b": dict(layers=28, hidden=1024, intermediate=3072, heads=16, kv_heads=8, vocab=151936,
                           tied=True, head_dim=128),
        "qwen3-8b": dict(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, vocab=151936),
    }

    def qkv_bias(self, model_type: str, config: dict[str, Any]) -> bool:
        if config.get("attention_bias"):
            # Qwen3's attention_bias also puts a bias on o_proj, which no family here counts.
            raise ValueError("attention_bias true: a Qwen3 with biased projections is not a shape memstrata plans")
        return False

    def attention_params(self, arch: Shape) -> int:
        return super().attention_params(arch) + 2 * arch.head_width  # q_norm and k_norm

    def attention_tensors(self, arch: Shape) -> list[int]:
        """Llama's q/k/v/o, then q_norm and k_norm, one head wide each."""
        return super().attention_tensors(arch) + [arch.head_width, arch.head_width]

    def layer_activation_bytes(self, arch: Shape, w: int) -> int:
        """Llama's (`Llama.layer_activation_bytes`) and the head norms', which keep what any RMSNorm keeps per
        head: the fp32 input (4 B an element), an fp32 rsqrt per head and the normalized output (w an element),
        over the queries (q wide, n heads) and the keys (kv wide, kv heads): (4 + w)(q + kv) + 4(n + kv heads).
        Measured with torch's saved-tensor hooks on transformers 5.23, bf16 and fp32, heads of hidden / heads and
        wider (tests/runtime/test_family_activations.py)."""
        heads = 4 * (arch.heads + arch.kv_heads)
        return super().layer_activation_bytes(arch, w) + (4 + w) * (arch.q_dim + arch.kv_dim) + heads

    def preset_config(self, arch: Shape, sequence_length: int) -> tuple[str, dict[str, Any]]:
        return "qwen3", self.common_config(arch, sequence_length)


FAMILY = Qwen3()
