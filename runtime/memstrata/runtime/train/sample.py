"""A model's answer to one prompt, for showing what fine-tuning changed.

`answer`: plain `transformers` on the CPU or the first GPU, greedy decoding, the chat template when the
tokenizer has one: it loads the whole model, so it is for small models and the saved output (the demo's before
and after). `engine_answer`: the training engine's own model at an evaluation (training.evalSamplePrompt),
ZeRO-3 partitioned, every rank generating in step (each forward gathers the weights from all of them).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["answer", "engine_answer"]


def answer(model_dir: Path, prompt: str, max_new_tokens: int = 48) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
    else:
        text = prompt
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not tokenizer.chat_template)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return str(tokenizer.decode(out[0][ids["input_ids"].shape[1]:], skip_special_tokens=True)).strip()


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
