"""A model's answer to one prompt, for showing what fine-tuning changed.

Plain `transformers` on the CPU or the first GPU, greedy decoding, the chat template when the tokenizer has
one: it loads the whole model, so it is for small models and the saved output (the demo's before and after);
the engine's own answer at an evaluation is memstrata.runtime.train.model.generate.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["answer"]


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

