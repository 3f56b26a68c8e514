"""Llama's blocks, and those of the models built like them (Qwen2, Mistral, SmolLM2): RMSNorm, rotary positions,
q/k/v/o projections without biases (Q/K/V biases in Qwen2), grouped-query attention, a 3-matrix SwiGLU MLP."""
from __future__ import annotations

from typing import Any, ClassVar

from memstrata.api.families.base import NO_SPECIAL_TOKENS, Linear, ModelFamily, Shape



class Llama(ModelFamily):
    name = "llama"
    title = "Llama-family"
    # Also the family of any other model type no family names: its config is read with Llama's field names.
    model_types = frozenset({"llama", "qwen2", "mistral"})
    qkv_bias_model_types = frozenset({"qwen2"})
    free_head_dim = True
    lora_defaults: ClassVar[tuple[str, ...]] = ("q_proj", "v_proj")
    presets = {
        # Shapes only: for planning real jobs (random weights build too: the long-context benchmark on a GPU).
        "llama3.2-1b": dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256,
                            tied=True),
        "llama3-8b": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256),
        "llama3-70b": dict(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=128256),
        "qwen2.5-14b": dict(layers=48, hidden=5120, intermediate=13824, heads=40, kv_heads=8, vocab=152064,
                            qkv_bias=True),
        "mistral-7b": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000),
        # Heads narrower than hidden / heads (128 against 160): q and o are 4096 wide at hidden 5120.
        "mistral-nemo-12b": dict(layers=40, hidden=5120, intermediate=14336, heads=32, kv_heads=8, vocab=131072,
                                 head_dim=128),
    }

    def tensor_sizes(self, arch: Shape) -> list[int]:
        """The embedding, every layer's tensors (`layer_tensors`), the final norm; the head unless tied."""
        v, h = arch.vocab, arch.hidden
        return [v * h] + self.layer_tensors(arch) * arch.layers + [h] + ([] if arch.tied else [v * h])

    def layer_tensors(self, arch: Shape) -> list[int]:
        """One layer's, in `model.parameters()` order: the attention's, then gate/up/down, then two RMSNorms."""
        h, i = arch.hidden, arch.intermediate
        return self.attention_tensors(arch) + [i * h, i * h, h * i, h, h]

    def attention_tensors(self, arch: Shape) -> list[int]:
        """q/k/v/o apart (Q/K/V biases in Qwen2)."""
        h, q, kv, bias = arch.hidden, arch.q_dim, arch.kv_dim, arch.qkv_bias
        return [q * h, *([q] if bias else []), kv * h, *([kv] if bias else []), kv * h, *([kv] if bias else []),
                h * q]

    def layer_linears(self, arch: Shape) -> list[Linear]:
        h, i, q, kv = arch.hidden, arch.intermediate, arch.q_dim, arch.kv_dim
        return [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h),
                ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]

    def norm_bytes(self, arch: Shape, w: int) -> int:
        """What one RMSNorm keeps a token: its input upcast to fp32 (4h), its fp32 rsqrt (4 B) and its
        normalized output (hw), which the weight's gradient needs."""
        return 4 * arch.hidden + 4 + arch.hidden * w

    def layer_activation_bytes(self, arch: Shape, w: int) -> int:
        """Both RMSNorms' (`norm_bytes`); the q/k/v projections share their input (hw); the rotated query (qw: q
        is the queries' width, h unless headDim says), key and value (2·kv·w: sdpa takes grouped-query attention
        without repeating them); sdpa's output, which o_proj keeps (qw), and its fp32 log-sum-exp (4n); the rotary
        cos and sin (2·d·w, d the head width); the MLP's input (hw), gate, SiLU(gate), up and their product (4iw):
        8h + 8 + 4hw + 2qw + 2·kv·w + 4n + 2dw + 4iw.
        Measured with torch's saved-tensor hooks on transformers 5.23 at b = 1, equal to the formula: Llama-3.2-1B
        201,352 B in fp32, Qwen2.5-14B 217,768 in bf16 (at b > 1 the rotary tables are per position, not per
        token: SmolLM2-135M at b = 2 saves 24,748 B of the formula's 24,876 in bf16)."""
        h, i, n = arch.hidden, arch.intermediate, arch.heads
        rest = 2 * h * w + 2 * arch.q_dim * w + 2 * arch.kv_dim * w + 4 * n + 2 * arch.head_width * w + 4 * i * w
        return 2 * self.norm_bytes(arch, w) + rest

    def head_input_bytes(self, arch: Shape, w: int) -> int:
        """The final RMSNorm's (`norm_bytes`, its rsqrt aside) and the head's input (hw): (4 + 2w)·h."""
        return self.norm_bytes(arch, w) - 4 + arch.hidden * w

    def preset_config(self, arch: Shape, sequence_length: int) -> tuple[str, dict[str, Any]]:
        return "qwen2" if arch.qkv_bias else "llama", self.common_config(arch, sequence_length)

    def common_config(self, arch: Shape, sequence_length: int) -> dict[str, Any]:
        """The config arguments every Llama-style model type takes by these names."""
        return dict(vocab_size=arch.vocab, hidden_size=arch.hidden, intermediate_size=arch.intermediate,
                    num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
                    num_key_value_heads=arch.kv_heads, max_position_embeddings=max(sequence_length, 2048),
                    head_dim=arch.head_width, tie_word_embeddings=arch.tied, use_cache=False, **NO_SPECIAL_TOKENS)


FAMILY = Llama()
