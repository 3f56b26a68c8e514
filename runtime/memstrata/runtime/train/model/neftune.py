"""NEFTune (Jain et al., 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning"), as transformers'
Trainer and TRL apply it: while the model trains, uniform noise in [-m, m] with m = alpha / sqrt(L * d) is added
to the input embeddings' output (L positions of the sequence, d the hidden size). Only in training mode: the
validation loss, a sample and the saved model see clean embeddings, and nothing of it is saved.
"""
from __future__ import annotations

import math
from typing import Any

__all__ = ["install_neftune"]


def install_neftune(model: Any, alpha: float) -> Any:
    """Add the noise to `model`'s input embeddings while it trains; returns the hook's handle."""
    embeddings = model.get_input_embeddings()

    def noisy(module: Any, _args: Any, output: Any) -> Any:
        if not module.training:
            return output
        magnitude = alpha / math.sqrt(output.size(1) * output.size(2))
        return output + output.new_empty(output.shape).uniform_(-magnitude, magnitude)

    return embeddings.register_forward_hook(noisy)
