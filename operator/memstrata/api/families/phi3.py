"""Phi-3's blocks (Phi-3-mini and -medium, `model_type: phi3`): Llama's arithmetic (RMSNorm, rotary positions,
grouped-query attention, a SwiGLU MLP, no biases) in fused tensors. Q, K and V are one `qkv_proj` and the MLP's
gate and up one `gate_up_proj`, registered after `o_proj`. The parameter count is Llama's. The tensor list the
planner cuts into sub-groups, and the names LoRA targets, are Phi-3's own."""
from __future__ import annotations

from typing import Any

from memstrata.api.families.base import Linear, Shape
from memstrata.api.families.llama import Llama


class Phi3(Llama):
    name = "phi3"
    title = "Phi-3"
    model_types = frozenset({"phi3"})
    qkv_bias_model_types = frozenset()
    # PEFT names no default targets for phi3; the fused attention input is Llama's q_proj and v_proj (and k).
    lora_defaults = ("qkv_proj",)
    presets = {
        # Phi-3-mini's shape (3.8B, 32 heads of 96, a 32,064-token vocabulary, the head untied): for planning.
        "phi3-mini": dict(layers=32, hidden=3072, intermediate=8192, heads=32, kv_heads=32, vocab=32064),
    }

    def qkv_bias(self, model_type: str, config: dict[str, Any]) -> bool:
        return False  # Phi-3's projections have no biases, whatever `attention_bias` says

    def layer_tensors(self, arch: Shape) -> list[int]:
        """o_proj, qkv_proj, gate_up_proj, down_proj, two RMSNorms (`model.parameters()` order)."""
        h, i, q, kv = arch.hidden, arch.intermediate, arch.q_dim, arch.kv_dim
        return [h * q, (q + 2 * kv) * h, 2 * i * h, h * i, h, h]

    def layer_linears(self, arch: Shape) -> list[Linear]:
        h, i, q, kv = arch.hidden, arch.intermediate, arch.q_dim, arch.kv_dim
        return [("o_proj", q, h), ("qkv_proj", h, q + 2 * kv), ("gate_up_proj", h, 2 * i), ("down_proj", i, h)]

    def layer_activation_bytes(self, arch: Shape, w: int) -> int:
        """Llama's (`Llama.layer_activation_bytes`) and two more: the value sdpa keeps is a view of the fused
        qkv_proj output, so all of it stays alive ((q + kv)·w beyond the value's own kv·w); and sdpa's output,
        whose layout o_proj's input cannot view, is kept beside its contiguous copy (qw). Measured with torch's
        saved-tensor hooks (each storage once) on transformers 5.23's Phi-3, CPU sdpa, in bf16 and fp32
        (tests/runtime/test_family_activations.py); a kernel whose output o_proj can view keeps qw less, so the
        count errs on the safe side."""
        return super().layer_activation_bytes(arch, w) + (2 * arch.q_dim + arch.kv_dim) * w

    def preset_config(self, arch: Shape, sequence_length: int) -> tuple[str, dict[str, Any]]:
        return "phi3", self.common_config(arch, sequence_length)


FAMILY = Phi3()
