"""The torch model built from a `ModelArchitecture`: a small, readable decoder-only transformer.

Two families, matching the planner's byte accounting parameter for parameter
(a test holds `count_parameters(build_model(a)) == a.parameters()`):

- `gpt`: GPT-2 style — learned positions, LayerNorm with bias, biased Q/K/V/O
  projections, a 2-matrix GELU MLP, LM head tied to the token embedding.
- `llama`: RMSNorm, rotary positions, grouped-query attention, a 3-matrix SwiGLU
  MLP, no biases (Q/K/V biases only with `qkvBias`, as in Qwen2).

Under ZeRO-3 every parameter is gathered by the hooks of the module that owns
it, so the tied head is an `nn.Linear` whose weight *is* the embedding's
Parameter (one object, two owners) rather than a functional call on
`embed.weight` from another module, which ZeRO-3 would not have gathered.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memstrata.api.architecture import ModelArchitecture

ROPE_BASE = 10000.0
NORM_EPS = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: bf16's 8-bit mantissa makes the mean of squares noisy.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return h.type_as(x) * self.weight


def rotary(x: torch.Tensor, base: float = ROPE_BASE) -> torch.Tensor:
    """Rotary positions on x (batch, heads, seq, head_dim).

    Channel i is paired with channel i + head_dim/2 (the "rotate half" layout of
    Hugging Face Llama checkpoints, so their Q/K weights work unpermuted).
    """
    seq, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    h = x.float()
    x1, x2 = h[..., : dim // 2], h[..., dim // 2:]
    return (h * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, arch: ModelArchitecture) -> None:
        super().__init__()
        gpt = arch.family == "gpt"
        h, kv = arch.hidden, arch.kv_dim
        self.heads, self.kv_heads, self.head_dim = arch.heads, arch.kv_heads, arch.head_dim
        self.rope = not gpt
        self.q = nn.Linear(h, h, bias=gpt or arch.qkv_bias)
        self.k = nn.Linear(h, kv, bias=gpt or arch.qkv_bias)
        self.v = nn.Linear(h, kv, bias=gpt or arch.qkv_bias)
        self.o = nn.Linear(h, h, bias=gpt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = rotary(q), rotary(k)
        if self.kv_heads != self.heads:  # grouped-query: each K/V head serves heads/kv_heads query heads
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class GeluMlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, intermediate)
        self.down = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class SwiGluMlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def _norm(arch: ModelArchitecture) -> nn.Module:
    return nn.LayerNorm(arch.hidden, eps=NORM_EPS) if arch.family == "gpt" else RMSNorm(arch.hidden)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, arch: ModelArchitecture) -> None:
        super().__init__()
        self.attn_norm = _norm(arch)
        self.attn = Attention(arch)
        self.mlp_norm = _norm(arch)
        mlp = GeluMlp if arch.family == "gpt" else SwiGluMlp
        self.mlp = mlp(arch.hidden, arch.intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab); `forward` with labels returns the mean loss."""

    def __init__(self, arch: ModelArchitecture) -> None:
        super().__init__()
        self.arch = arch
        self.embed = nn.Embedding(arch.vocab, arch.hidden)
        self.positions = nn.Embedding(arch.max_positions, arch.hidden) if arch.family == "gpt" else None
        self.blocks = nn.ModuleList(Block(arch) for _ in range(arch.layers))
        self.norm = _norm(arch)
        self.head = nn.Linear(arch.hidden, arch.vocab, bias=False)
        if arch.tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(ids)
        if self.positions is not None:
            x = x + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        # The loss in fp32: a bf16 log-softmax over the vocabulary loses the small probabilities.
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def init_weights(model: Decoder, seed: int) -> None:
    """GPT-2's initialisation (normal, std 0.02; residual outputs scaled by 1/sqrt(2·layers)), seeded."""
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / (2 * model.arch.layers) ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                # Norm gains start at 1 and every bias at 0.
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
                continue
            std = residual_std if name.endswith(("attn.o.weight", "mlp.down.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def build_model(arch: ModelArchitecture, seed: int) -> Decoder:
    model = Decoder(arch)
    init_weights(model, seed)
    return model


def count_parameters(model: nn.Module) -> int:
    """Trainable elements, each shared Parameter counted once (as `ModelArchitecture.parameters()` does)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def largest_parameter(model: nn.Module) -> int:
    return max(p.numel() for p in model.parameters())
