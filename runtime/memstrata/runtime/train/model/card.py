"""The model card (`README.md`) written with every fine-tuned model: what it was trained from, on what, how, and
how the loss went, in the Hugging Face card format (YAML metadata, then prose) that the Hub and `huggingface_hub`'s
ModelCard read."""
from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping, Sequence

import yaml

from memstrata.api.finetunejob import FineTuneJobSpec

__all__ = ["model_card"]


def _data(spec: FineTuneJobSpec, formats: Sequence[str]) -> list[str]:
    d = spec.dataset
    if d.synthetic is not None:
        return [f"the synthetic `{d.synthetic}` set"]
    found = list(formats) or [s.format for s in d.sources()]
    return [f"`{s.path}` ({fmt} format" + (f", weight {s.weight:g})" if d.mix else ")")
            for s, fmt in zip(d.sources(), found)]


def _method(spec: FineTuneJobSpec) -> str:
    lora = spec.training.adapter()
    if lora is None:
        return "full fine-tune (every parameter trained)"
    scale = "alpha / sqrt(rank), rsLoRA" if lora.use_rslora else "alpha / rank"
    targets = ", ".join(lora.target_modules or ["the family's default modules"])
    return f"{'DoRA' if lora.use_dora else 'LoRA'}, rank {lora.rank}, alpha {lora.alpha:g} ({scale}), on {targets}"


def model_card(spec: FineTuneJobSpec, *, job: str, step: int, losses: Sequence[float],
               validation: Mapping[int, float], formats: Sequence[str] = (), best: bool = False) -> str:
    """The card of the model of `step` of `job`; `losses`: the training loss of each step trained in this
    attempt; `validation`: validation loss by step (0: before training); `formats`: each dataset's format as
    read (the spec may say auto); `best`: it is the model of the lowest validation loss (keepBest)."""
    t = spec.training
    base = spec.model.preset or str(spec.model.path)
    meta = {"base_model": base, "library_name": "peft" if t.adapter() else "transformers",
            "tags": ["memstrata", "fine-tuned", "lora" if t.adapter() else "full-fine-tune"]}
    lines = [f"# {job}", "", f"Fine-tuned from `{base}` by memstrata {_version()}, job `{job}`: the model of "
             f"step {step}.", "", "## Training", "", f"- Method: {_method(spec)}",
             f"- Data: {'; '.join(_data(spec, formats))}", f"- Steps: {step} of {t.steps} (micro-batch {t.micro_batch} x "
             f"{t.gradient_accumulation} accumulation, sequences of {t.sequence_length} tokens, "
             f"{'packed' if spec.dataset.packing else 'padded'})",
             f"- Optimizer: AdamW, learning rate {t.learning_rate:g} ({t.schedule.type} schedule), weight decay "
             f"{t.optimizer.weight_decay:g}, precision {t.precision}, seed {t.seed}"]
    if t.neftune_noise_alpha is not None:
        lines.append(f"- NEFTune noise alpha {t.neftune_noise_alpha:g}")
    lines += ["", "## Results", ""]
    if losses:
        lines.append(f"- Training loss: {losses[0]:.4f} at the first step of this run, {losses[-1]:.4f} at the last")
    if validation:
        lines.append("- Validation loss: " + ", ".join(f"{v:.4f} at step {s}" for s, v in sorted(validation.items())))
    if best:
        lines.append("- This is the model of the lowest validation loss (training.keepBest).")
    return f"---\n{yaml.safe_dump(meta, sort_keys=False)}---\n\n" + "\n".join(lines) + "\n"


def _version() -> str:
    try:
        return importlib.metadata.version("memstrata")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"
