"""The model families memstrata plans and trains, one module each, and the registry the rest of the code asks.

Adding a family is a module here (a `ModelFamily` subclass and its instance `FAMILY`) and a line in `_ALL`:
the API's `family` values and presets, the config reader, the planner, LoRA's targets and the runtime's model
all come from the registry.
"""
from __future__ import annotations

from memstrata.api.families import gemma, gpt, llama, phi3, qwen3
from memstrata.api.families.base import Linear, ModelFamily

__all__ = ["FAMILIES", "DEFAULT_FAMILY", "Linear", "ModelFamily", "family", "family_of_model_type"]

_ALL: tuple[ModelFamily, ...] = (gpt.FAMILY, llama.FAMILY, gemma.FAMILY, phi3.FAMILY, qwen3.FAMILY)
FAMILIES: dict[str, ModelFamily] = {f.name: f for f in _ALL}
# The family of a model type no family names: most causal LMs are built like Llama and use its config names.
DEFAULT_FAMILY = llama.FAMILY


def family(name: str) -> ModelFamily:
    """The family named `name` (KeyError naming the known ones otherwise)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r} (known: {', '.join(FAMILIES)})") from None


def family_of_model_type(model_type: str) -> ModelFamily:
    """The family a Hugging Face `model_type` is read as."""
    return next((f for f in _ALL if model_type in f.model_types), DEFAULT_FAMILY)
