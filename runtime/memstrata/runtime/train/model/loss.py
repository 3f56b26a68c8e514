"""The causal-LM loss taken over the vocabulary a chunk of tokens at a time.

Hugging Face's loss projects every position onto the vocabulary at once and
upcasts it: s x vocab logits in 16-bit plus an fp32 copy (and their gradient in
backward). At 32K tokens of a 128K vocabulary that is 8 GiB + 16 GiB, more than
the whole 1B model it trains. Here the LM head computes `chunk_tokens` rows of
logits, their cross-entropy sum, and drops them; each chunk is a non-reentrant
checkpoint, so backward recomputes its logits one chunk at a time too.

The head stays one module call per forward (its forward is replaced on the
instance), so ZeRO-3 gathers its weight once for forward and once for backward,
exactly as for the stock loss; a tied head is the embedding's own parameter, as
before. Without labels the head and the model behave as Hugging Face's
(logits), so evaluation with generation and export are untouched.
"""
from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memstrata.runtime.train.data.packing import IGNORE as IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["IGNORE_INDEX", "chunked_cross_entropy", "chunked_loss_refusal", "install_chunked_loss"]

# What a model's own forward may do beyond `lm_head(hidden)`, by config attribute and its neutral value: Granite
# divides the logits by `logits_scaling`, Cohere multiplies them by `logit_scale`, Gemma 2 and 3 soft-cap them,
# and mixture-of-experts models add their router's loss. The chunked loss does none of it, so it refuses them.
_LOGIT_CHANGES: dict[str, Any] = {"logits_scaling": 1.0, "logit_scale": None, "final_logit_softcapping": None,
                                  "output_router_logits": False}


def chunked_loss_refusal(config: Any) -> str | None:
    """Why the chunked loss would not be this model's own loss (None: it is)."""
    changed = [f"{name}={getattr(config, name)!r}" for name, neutral in _LOGIT_CHANGES.items()
               if getattr(config, name, neutral) not in (neutral, None)]
    if changed:
        return (f"{type(config).__name__} changes its logits or its loss beyond the LM head ({', '.join(changed)}), "
                "which the chunked loss would leave out")
    return None


def _chunk_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Mean next-token cross-entropy of `hidden` [b, s, h] projected by `weight` [vocab, h], with `labels`
    [b, s] at the inputs' positions (Hugging Face's convention: position t is scored on label t+1), over the
    labels that are not IGNORE_INDEX; the logits exist `chunk_tokens` rows at a time."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    h = hidden[:, :-1, :].reshape(-1, hidden.size(-1))
    y = labels[:, 1:].reshape(-1).to(hidden.device)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, y.numel(), chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_chunk_sum, h[start:end], weight, bias, y[start:end], use_reentrant=False)
    # HF divides by the scored labels too; with none scored it gives nan, here 0 (nothing to learn, no harm).
    return total / (y != IGNORE_INDEX).sum().clamp(min=1)


def _head_forward(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor | None = None, *,
                  chunk_tokens: int) -> torch.Tensor:
    if labels is None:
        return F.linear(hidden, head.weight, head.bias)
    # Layer-major (memstrata.runtime.train.model.layermajor): the rows are that many micro-batches stacked, and the
    # loss is the mean of their own means, as DeepSpeed accumulates loss / G over a loop of them.
    groups = getattr(head, "memstrata_groups", 1)
    losses = [chunked_cross_entropy(h, head.weight, head.bias, y, chunk_tokens)
              for h, y in zip(hidden.chunk(groups), labels.chunk(groups))]
    return losses[0] if groups == 1 else torch.stack(losses).mean()


def _model_forward(self: "PreTrainedModel", input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                   **kwargs: Any) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if labels is None:
        return type(self).forward(self, input_ids=input_ids, **kwargs)
    for unused in ("use_cache", "output_attentions", "output_hidden_states", "return_dict", "logits_to_keep"):
        kwargs.pop(unused, None)  # peft passes these through; the decoder's defaults are what training wants
    hidden = self.get_decoder()(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state
    return CausalLMOutputWithPast(loss=self.get_output_embeddings()(hidden, labels=labels))


def install_chunked_loss(model: "PreTrainedModel", chunk_tokens: int) -> None:
    """Make `model(input_ids=..., labels=...)` take its loss by chunks of `chunk_tokens` tokens (its output then
    has the loss and no logits); without labels it is unchanged."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"spec.training.lossChunkTokens: {type(model).__name__}'s output layer is a "
                         f"{type(head).__name__}, not a plain linear head; set lossChunkTokens: 0")
    # Instance attributes: the class and every other model stay as they are.
    setattr(head, "forward", functools.partial(_head_forward, head, chunk_tokens=chunk_tokens))
    setattr(model, "forward", types.MethodType(_model_forward, model))
