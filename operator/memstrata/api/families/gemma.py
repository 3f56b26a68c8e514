"""Gemma's blocks (Gemma 1): Llama's layout (q/k/v/o, gate/up/down, two RMSNorms a layer, the same tensors in the
same order) with a GeGLU MLP (tanh-approximated GELU), an RMSNorm that scales by (1 + weight) in fp32, the
embedding scaled by sqrt(hidden) and the LM head tied to it. What differs for memstrata is the bytes its norms
keep for backward; Gemma-2's and -3's extra norms and logit soft-capping are other families."""
from __future__ import annotations

from typing import Any

from memstrata.api.families.base import Shape
from memstrata.api.families.llama import Llama



class Gemma(Llama):
    name = "gemma"
    title = "Gemma"
    model_types = frozenset({"gemma"})
    qkv_bias_model_types = frozenset()
    tied_by_default = True
    default_head_dim = 256  # GemmaConfig's
    lora_defaults = ("q_proj", "v_proj")
    presets = {
        # Gemma-2B's shape (multi-query attention, head_dim 256 = 2048 / 8, 256k vocabulary): for planning.
        "gemma-2b": dict(layers=18, hidden=2048, intermediate=16384, heads=8, kv_heads=1, vocab=256000, tied=True),
        # Gemma-7B's: heads wider than hidden / heads (256 against 192), so q and o are 4096 wide at hidden 3072.
        "gemma-7b": dict(layers=28, hidden=3072, intermediate=24576, heads=16, kv_heads=16, vocab=256000, tied=True,
                         head_dim=256),
    }

    def norm_bytes(self, arch: Shape, w: int) -> int:
        """Gemma's RMSNorm normalizes and scales in fp32 and casts last: it keeps its fp32 input (4h), rsqrt (4 B)
        and fp32 normalized output (4h), whatever the training precision (measured with torch's saved-tensor
        hooks on transformers 5.23: 2·(4 - w)·h more a layer than Llama's in bf16, equal in fp32)."""
        return 8 * arch.hidden + 4

    def preset_config(self, arch: Shape, sequence_length: int) -> tuple[str, dict[str, Any]]:
        return "gemma", {**self.common_config(arch, sequence_length), "hidden_activation": "gelu_pytorch_tanh"}


FAMILY = Gemma()
