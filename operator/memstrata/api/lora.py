"""LoRA (`training.method: lora`): the adapter settings, and the adapter's shape for the planner.

Low-rank adaptation (Hu et al., 2021), as PEFT implements it: every targeted linear module keeps its
weight W frozen and learns W + (alpha / rank)·B·A, where A (rank x in) and B (out x rank) are the only
tensors that train. So the optimizer state, the fp32 master weights and the gradients exist for the
adapters alone; the frozen base weights are only read.

Pure: the shapes here are what `transformers` builds for a family (each family's `layer_linears`, in
memstrata.api.families, beside its full tensor list), so the planner counts the adapters without the model
directory, and a target module the family does not have is refused with the module names it does have.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field, model_validator

from memstrata.api.architecture import Family, ModelArchitecture
from memstrata.api.base import ApiModel, cel
from memstrata.api.families import Linear
from memstrata.api.families import family as family_of

ModuleName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^([A-Za-z_][A-Za-z0-9_]*|all-linear)$")]
ALL_LINEAR = "all-linear"  # PEFT's word for every linear module of the layers


class Lora(ApiModel):
    """Low-rank adapters on the named linear modules of every layer; the base weights stay frozen (no gradients,
    no optimizer state) on whatever stratum the plan puts them. The output is the adapter in PEFT format
    (`adapter_config.json`, `adapter_model.safetensors`), which `peft.PeftModel.from_pretrained(base, path)`
    loads over the base model."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [cel(
        "!has(self.targetModules) || !('all-linear' in self.targetModules) || size(self.targetModules) == 1",
        "training.lora.targetModules: all-linear names every linear module; give it alone", ".targetModules")]})

    rank: int = Field(16, gt=0, le=4096, description="r: the adapters' inner width (A is rank x in, B out x rank).")
    alpha: float = Field(32.0, gt=0, le=1e6, description="lora_alpha: the update B x A is scaled by alpha / rank.")
    target_modules: list[ModuleName] | None = Field(
        None, min_length=1, max_length=64,
        description="The transformer layers' linear modules that get adapters, by name (every layer's module of "
                    "that name): q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (Llama-family "
                    "models: Llama, Qwen2, Qwen3, Mistral, Gemma, SmolLM2), o_proj, qkv_proj, gate_up_proj, "
                    "down_proj (Phi-3) or c_attn, c_proj, c_fc (GPT-2); default: q_proj and v_proj, qkv_proj (Phi-3) "
                    "or c_attn; `all-linear`: every one of them (PEFT's all-linear, the LM head excepted).",
        json_schema_extra={"x-kubernetes-list-type": "set"})
    use_rslora: bool = Field(False, description="Rank-stabilized LoRA: the update is scaled by alpha / sqrt(rank) "
                                                "instead of alpha / rank (PEFT's use_rslora).")
    use_dora: bool = Field(False, description="DoRA (Liu et al., 2024; PEFT's use_dora): each targeted weight is "
                                              "learnt as a magnitude (one trained value per output feature, starting "
                                              "at the weight's column norms) times the direction W + scaling x B x A; "
                                              "the magnitudes train with the adapters and are counted by the planner.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapters' input while training.")
    modules_to_save: list[ModuleName] | None = Field(
        None, min_length=1, max_length=2,
        description="Modules outside the layers that train whole beside the adapters and are saved in the adapter, "
                    "as PEFT's modules_to_save: the input embedding (embed_tokens; GPT-2: wte) and the LM head "
                    "(lm_head), e.g. to learn a new chat format's tokens. Where the head is tied to the embedding "
                    "they are one tensor: name both. Their gradients, fp32 master and Adam moments are counted.",
        json_schema_extra={"x-kubernetes-list-type": "set"})
    merge_on_save: bool = Field(
        False, description="Also write the base model with the adapters merged in (W + alpha / rank x B x A), a plain "
                           "Hugging Face model, to `<output.path>/merged`.")

    @model_validator(mode="after")
    def _distinct(self) -> "Lora":
        names = self.target_modules or []
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"training.lora.targetModules: {', '.join(twice)} given twice")
        if ALL_LINEAR in names and len(names) > 1:
            raise ValueError(f"training.lora.targetModules: {ALL_LINEAR} names every linear module; give it alone "
                             f"(got {', '.join(names)})")
        return self

    def targets(self, arch: ModelArchitecture) -> list[str]:
        """The target modules: every linear module's name for all-linear, the family's default when none are
        named."""
        if self.target_modules == [ALL_LINEAR]:
            return linear_names(arch)
        return list(self.target_modules) if self.target_modules else list(family_of(arch.family).lora_defaults)


def layer_linears(arch: ModelArchitecture) -> list[Linear]:
    """(name, in_features, out_features) of one transformer layer's linear modules, in `model.parameters()`
    order, as `arch`'s family declares them (GPT-2's two c_proj modules: a target name takes both)."""
    return arch.spec.layer_linears(arch)


def linear_names(arch: ModelArchitecture) -> list[str]:
    """Every module name a target may be, for `arch`'s family. Not the LM head: it is tied to the embedding in
    many models (a merged model could not keep both), and the chunked loss replaces its forward."""
    return list(dict.fromkeys(name for name, _, _ in layer_linears(arch)))


HEAD = "lm_head"


def savable_modules(arch: ModelArchitecture) -> list[str]:
    """What training.lora.modulesToSave may name for `arch`'s family: its input embedding and the LM head."""
    return [family_of(arch.family).embedding_module, HEAD]


def modules_to_save_problem(lora: Lora, arch: ModelArchitecture) -> str | None:
    """Why training.lora.modulesToSave cannot be trained as named on `arch` (None: it can)."""
    named, savable = lora.modules_to_save or [], savable_modules(arch)
    unknown = [n for n in named if n not in savable]
    if unknown:
        return (f"training.lora.modulesToSave: {', '.join(unknown)}: not a module memstrata trains beside LoRA on a "
                f"{arch.spec.title} model (it may name {' and '.join(savable)})")
    if arch.tied and len(set(named)) == 1:
        return (f"training.lora.modulesToSave: {named[0]}: this model's LM head is its input embedding (tied), so "
                f"training one trains both: name both ({' and '.join(savable)}), which PEFT then loads as one")
    return None


def saved_tensor_sizes(arch: ModelArchitecture, lora: Lora) -> tuple[list[int], list[int]]:
    """(before, after): elements of the base tensors training.lora.modulesToSave trains, that come before the
    layers' adapters in `model.parameters()` (the embedding) and after them (an untied head; a tied one is the
    embedding's tensor, counted once)."""
    named, (embedding, _) = set(lora.modules_to_save or []), savable_modules(arch)
    rows = arch.vocab * arch.hidden
    before = [rows] if embedding in named or (arch.tied and HEAD in named) else []
    after = [rows] if HEAD in named and not arch.tied else []
    return before, after


def unknown_targets(lora: Lora, arch: ModelArchitecture) -> list[str]:
    known = set(linear_names(arch))
    return [t for t in lora.targets(arch) if t not in known]


def check_targets(lora: Lora, arch: ModelArchitecture) -> None:
    """ValueError naming training.lora.targetModules when a target is not a linear module of `arch`'s family."""
    unknown = unknown_targets(lora, arch)
    if unknown:
        raise ValueError(f"training.lora.targetModules: {', '.join(unknown)}: not a linear module of a "
                         f"{arch.spec.title} "
                         f"model's layers (those that take adapters: {', '.join(linear_names(arch))})")
    saving = modules_to_save_problem(lora, arch)
    if saving is not None:
        raise ValueError(saving)


def adapter_tensor_sizes(arch: ModelArchitecture, lora: Lora) -> list[int]:
    """Elements of every tensor that trains under LoRA, in `model.parameters()` order: the adapters (A, B, then
    DoRA's magnitude in each module), with the base tensors modulesToSave names around them (`saved_tensor_sizes`).
    A module with in and out features gets rank·in + out·rank, and out more with DoRA."""
    check_targets(lora, arch)
    wanted, r = set(lora.targets(arch)), lora.rank
    layer = [n for name, fan_in, fan_out in layer_linears(arch) if name in wanted
             for n in (r * fan_in, fan_out * r, *((fan_out,) if lora.use_dora else ()))]
    before, after = saved_tensor_sizes(arch, lora)
    return before + layer * arch.layers + after
