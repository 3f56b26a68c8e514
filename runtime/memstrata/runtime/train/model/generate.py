"""The training engine's own answer to a prompt at an evaluation (training.evalSamplePrompt): the ZeRO-3
partitioned model in eval mode, greedy, every rank generating in step (each forward gathers the weights from all
of them, and greedy decoding of the same weights stops at the same token everywhere)."""
from __future__ import annotations

from typing import Any

__all__ = ["engine_answer"]


def engine_answer(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int, device: Any) -> str:
    """The greedy answer of `model` (in eval mode, the engine's module) to `prompt`, through `tokenizer` (the
    run's: its chat template when it has one), cut at the end-of-sequence token."""
    import torch
    from transformers import GenerationConfig

    if tokenizer.has_chat_template:
        text = tokenizer.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = tokenizer.encode_with_offsets(text)[0]
    else:
        ids = tokenizer.encode(prompt, first=True)
    inputs = torch.tensor([ids], device=device)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                              pad_token_id=tokenizer.pad_id, eos_token_id=tokenizer.eos_id)
    with torch.no_grad():
        out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), generation_config=config)
    new = out[0, len(ids):].tolist()
    if tokenizer.eos_id in new:
        new = new[: new.index(tokenizer.eos_id)]
    return str(tokenizer.decode(new)).strip()
