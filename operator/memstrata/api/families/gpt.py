"""GPT-2's blocks: learned positions, LayerNorm with bias, biased projections, Q/K/V fused in one `c_attn`
Conv1D, a 2-matrix GELU MLP; the LM head tied to the embedding."""
from __future__ import annotations

from typing import Any

from memstrata.api.families.base import NO_SPECIAL_TOKENS, Linear, ModelFamily, Shape



def _gpt(layers: int, hidden: int, heads: int, vocab: int = 50304, positions: int = 2048) -> dict[str, Any]:
    return dict(layers=layers, hidden=hidden, intermediate=4 * hidden, heads=heads, kv_heads=heads, vocab=vocab,
                tied=True, max_positions=positions)


class Gpt(ModelFamily):
    name = "gpt"
    title = "GPT-2"
    model_types = frozenset({"gpt2"})
    tied_by_default = True  # GPT-2 ties by default and says so only when it does not
    default_intermediate_ratio = 4
    learned_positions = True
    lora_defaults = ("c_attn",)
    lora_fan_in_fan_out = True  # Conv1D stores its weight transposed
    embedding_module = "wte"
    presets = {
        # Small enough to fine-tune on a 2-core CPU with NVMe offload in minutes.
        "gpt-tiny": _gpt(layers=2, hidden=128, heads=4, vocab=512, positions=512),
        "gpt-125m": _gpt(layers=12, hidden=768, heads=12),
        "gpt-350m": _gpt(layers=24, hidden=1024, heads=16),
    }

    def qkv_bias(self, model_type: str, config: dict[str, Any]) -> bool:
        return False  # every projection has a bias, counted by the family itself

    def embedding_params(self, arch: Shape) -> int:
        return arch.vocab * arch.hidden + arch.max_positions * arch.hidden

    def attention_params(self, arch: Shape) -> int:
        h, kv = arch.hidden, arch.kv_dim
        return 2 * h * h + 2 * h * kv + h + 2 * kv + h

    def mlp_params(self, arch: Shape) -> int:
        h, i = arch.hidden, arch.intermediate
        return 2 * h * i + i + h

    def norm_params(self, arch: Shape) -> int:
        return 2 * arch.hidden  # LayerNorm has a bias

    def largest_param(self, arch: Shape) -> int:
        return max(arch.largest_tensor(), arch.max_positions * arch.hidden)

    def tensor_sizes(self, arch: Shape) -> list[int]:
        """GPT-2 fuses Q/K/V into one `c_attn` matrix with one bias and has LayerNorms with biases."""
        h, i, v = arch.hidden, arch.intermediate, arch.vocab
        head = [] if arch.tied else [v * h]
        layer = [h, h, h * 3 * h, 3 * h, h * h, h, h, h, h * i, i, i * h, h]
        return [v * h, arch.max_positions * h] + layer * arch.layers + [h, h] + head

    def layer_linears(self, arch: Shape) -> list[Linear]:
        """Two modules are named c_proj (attention output and MLP output): a target name takes both."""
        h, i = arch.hidden, arch.intermediate
        return [("c_attn", h, 3 * h), ("c_proj", h, h), ("c_fc", h, i), ("c_proj", i, h)]

    def layer_activation_bytes(self, arch: Shape, w: int) -> int:
        """Both LayerNorms keep their input, output, mean and rstd (4hw + 4w); the fused q|k|v output (3hw);
        sdpa's output (hw) and log-sum-exp (4n); the MLP's input (counted with the norm's output), c_fc's output,
        the four tensors gelu_new's tanh formula keeps and c_proj's input (5iw):  8hw + 4w + 4n + 5iw.
        GPT-2 125M: 43,064 B in bf16, as torch's saved-tensor hooks measured it on transformers 5.23."""
        h, i, n = arch.hidden, arch.intermediate, arch.heads
        return 8 * h * w + 4 * w + 4 * n + 5 * i * w

    def head_input_bytes(self, arch: Shape, w: int) -> int:
        """The final LayerNorm's input and output (2hw)."""
        return 2 * arch.hidden * w

    def preset_config(self, arch: Shape, sequence_length: int) -> tuple[str, dict[str, Any]]:
        return "gpt2", dict(vocab_size=arch.vocab, n_positions=arch.max_positions, n_embd=arch.hidden,
                            n_layer=arch.layers, n_head=arch.heads, n_inner=arch.intermediate,
                            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            tie_word_embeddings=arch.tied, use_cache=False, **NO_SPECIAL_TOKENS)


FAMILY = Gpt()
