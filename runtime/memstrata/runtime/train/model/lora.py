"""`training.method: lora` in the runtime: PEFT's adapters on the ZeRO-3 model, and the adapter out.

The base model is built and loaded exactly as for a full fine-tune (straight into its ZeRO-3 partitions, on
whatever strata the plan chose); `add_adapters` then wraps it with PEFT's LoRA layers, whose A and B tensors
are ordinary tensors until `deepspeed.initialize` partitions them like every other parameter. Only they are
handed to the optimizer (`trainable`), so ZeRO-3 builds gradients, fp32 master weights and Adam moments for
them alone - the planner's count (memstrata.api.lora) - and never writes the frozen base weights back.

The output is the adapter in PEFT's format (`adapter_config.json`, `adapter_model.safetensors`) beside the
tokenizer, and with `mergeOnSave` also the merged model under `merged/`, a plain Hugging Face directory. PEFT's
own `save_pretrained` would read the ZeRO-3 placeholders (empty tensors), so every tensor is gathered first,
and the whole output is written like a full model's: into a temporary directory renamed into place, its run
file last, so a retry recognises finished work (memstrata.runtime.train.model.export).
"""
from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memstrata.api.jobstatus import OutputStatus
from memstrata.api.architecture import Family, ModelArchitecture
from memstrata.api.families import family as family_of
from memstrata.api.lora import Lora, check_targets
from memstrata.runtime.train.model.export import (
    CARD,
    atomic_output,
    check_output_path,
    module_tensors,
    write_hf_model,
    write_run_file,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["ADAPTER", "ADAPTER_CONFIG", "MERGED", "LoraError", "add_adapters", "check_lora", "check_target_modules",
           "gather_for_dora", "join_save", "save_adapter", "trainable"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER = "adapter_model.safetensors"
MERGED = "merged"  # the merged full model's directory under spec.output.path
ADAPTER_NAME = "default"  # PEFT's name for a model's only adapter
FUSED_PROJECTIONS = ("qkv_proj", "gate_up_proj")


class LoraError(ValueError):
    """LoRA cannot be applied to this model as configured; the message names the field."""


def linear_module_names(config: "PretrainedConfig") -> list[str]:
    """The names (last component) of the linear modules in the transformer layers `transformers` builds for
    `config` (those under a numbered layer), found on the meta device: nothing is allocated, so a wrong target
    module is refused in a second, before the model is built."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return sorted({name.rpartition(".")[2] for name, module in model.named_modules()
                   if isinstance(module, (torch.nn.Linear, Conv1D)) and any(p.isdigit() for p in name.split("."))})


def check_lora(config: "PretrainedConfig", lora: Lora, arch: ModelArchitecture, *, preset: bool,
               output: bool) -> None:
    """Refuse, before anything is built, LoRA settings this model cannot train or save: a target module the model
    lacks (memstrata.api.lora checked the name against the family; this is the model's own word), and an adapter
    alone of a `preset`'s random base weights, which are saved nowhere, so nothing could ever load it."""
    if preset and output and not lora.merge_on_save:
        raise LoraError("spec.training.lora.mergeOnSave: a model.preset's base weights are random and saved nowhere, "
                        "so its adapter alone could never be loaded: set mergeOnSave: true (or use model.path)")
    try:
        check_targets(lora, arch)  # what the planner can count (a spec without the shape skipped this check)
    except ValueError as exc:
        raise LoraError(f"spec.{exc}") from None
    check_target_modules(config, lora, arch)


def check_target_modules(config: "PretrainedConfig", lora: Lora, arch: ModelArchitecture) -> None:
    """LoraError naming spec.training.lora.targetModules when `config`'s model has no module of a target's name."""
    available = linear_module_names(config)
    fused = [n for n in available if n in FUSED_PROJECTIONS]
    if fused:
        # Phi-3 and its kin plan as Llama-family models, whose adapters the planner counts per separate
        # projection; one message, rather than a list of modules that the next check would refuse in turn.
        raise LoraError(f"spec.training.lora: {type(config).__name__} fuses its projections ({', '.join(fused)}); "
                        "memstrata plans LoRA on separate q/k/v and gate/up projections only: use "
                        "training.method: full for this model")
    missing = [t for t in lora.targets(arch) if t not in available]
    if missing:
        raise LoraError(f"spec.training.lora.targetModules: {', '.join(missing)}: the model has no such linear "
                        f"module (its linear modules: {', '.join(available)})")


def add_adapters(model: "PreTrainedModel", lora: Lora, arch: ModelArchitecture, *, seed: int) -> Any:
    """`model` (built under ZeRO-3, weights loaded) wrapped in PEFT's LoRA layers: a `PeftModel` whose adapters
    alone require gradients."""
    import torch
    from peft import LoraConfig, get_peft_model

    # PEFT annotates lora_alpha as an int but scales by alpha / r in floating point: a fractional alpha works.
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha,  # type: ignore[arg-type]
                        lora_dropout=lora.dropout, use_rslora=lora.use_rslora, use_dora=lora.use_dora,
                        target_modules=lora.targets(arch), task_type="CAUSAL_LM",
                        # GPT-2's Conv1D stores its weight transposed: its family says so.
                        fan_in_fan_out=family_of(arch.family).lora_fan_in_fan_out)
    # A is drawn from the job's seed (B starts at zero), so a run is reproducible; `deepspeed.initialize` then
    # partitions the adapters like any parameter built outside zero.Init, broadcasting rank 0's values.
    torch.manual_seed(seed)
    # The adapters in the base weights' dtype: ZeRO-3 trains one precision, and keeps its own fp32 master copy.
    peft_model = get_peft_model(model, config, autocast_adapter_dtype=False)
    for module in saved_modules(model, lora, arch).values():
        # Trained in place: PEFT's own ModulesToSaveWrapper would deep-copy ZeRO-3's partitioned parameters.
        module.requires_grad_(True)
    return peft_model


def saved_modules(model: Any, lora: Lora, arch: ModelArchitecture) -> dict[str, Any]:
    """training.lora.modulesToSave's modules of the transformers `model`, by their path in it."""
    from memstrata.api.lora import savable_modules

    named = set(lora.modules_to_save or [])
    # savable_modules names the input embedding, then the head.
    modules = zip(savable_modules(arch), (model.get_input_embeddings(), model.get_output_embeddings()))
    wanted = {id(m) for name, m in modules if name in named}
    return {path: m for path, m in model.named_modules() if id(m) in wanted}


def gather_for_dora(model: Any) -> int:
    """After `deepspeed.initialize`: DoRA's magnitude module reads its layer's base weight (and bias) and the A and B weights
    in its own forward, outside the modules that own them, where ZeRO-3 holds them partitioned; registered as its
    external parameters, ZeRO-3 gathers them for it (and releases them after). The number of modules registered."""
    import deepspeed

    done = 0
    for module in model.modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if not magnitudes or ADAPTER_NAME not in magnitudes:
            continue
        dora = magnitudes[ADAPTER_NAME]
        for owner in (module.get_base_layer(), module.lora_A[ADAPTER_NAME], module.lora_B[ADAPTER_NAME]):
            for param in (owner.weight, getattr(owner, "bias", None)):  # the base's bias too (Qwen2, GPT-2)
                if param is not None:
                    deepspeed.zero.register_external_parameter(dora, param)
        done += 1
    return done


def trainable(model: Any) -> list["torch.nn.Parameter"]:
    """The parameters to hand to the optimizer: all of a full fine-tune's, only the adapters under LoRA. ZeRO-3
    builds optimizer sub-groups (fp32 master, moments, gradients) for these only."""
    return [p for p in model.parameters() if p.requires_grad]


# --- save -----------------------------------------------------------------------------------------------------
def _adapter_state(model: Any, lora: Lora, arch: ModelArchitecture) -> dict[str, "torch.Tensor"]:
    """The adapter's tensors under PEFT's saved names, gathered whole from their ZeRO-3 partitions (a
    collective: every rank calls it) and copied to the host; with modulesToSave each module's trained weight under
    `base_model.model.<its path>.weight`, as PEFT saves it (a tied head under both names: PEFT loads each)."""
    import deepspeed
    import torch
    from peft import get_peft_model_state_dict

    params = trainable(model)
    with deepspeed.zero.GatheredParameters([p for p in params if hasattr(p, "ds_id")], modifier_rank=None), \
            torch.no_grad():
        state = {n: p.detach().to("cpu", copy=True).contiguous() for n, p in model.named_parameters()
                 if p.requires_grad}
    # Drops the adapter's name from the keys, as PEFT's files have them; the frozen embeddings are the base's.
    out: dict[str, torch.Tensor] = get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER_NAME,
                                                             save_embedding_layers=False)
    stored: set[str] = set()
    for path, module in saved_modules(model.get_base_model(), lora, arch).items():
        weight = next(n for n, p in model.named_parameters() if p is module.weight)
        # A tied head is the embedding's tensor: safetensors stores no two names of one storage, so a copy.
        out[f"base_model.model.{path}.weight"] = state[weight].clone() if weight in stored else state[weight]
        stored.add(weight)
    return out


def _merged(model: Any) -> Iterator[list[tuple[str, "torch.Tensor"]]]:
    """The base model's tensors with each adapter merged into its module's weight (W + scaling·B·A, computed by
    PEFT's `get_delta_weight` in the weight's dtype, as PEFT's own `merge_and_unload` does), under the base
    model's names, one module at a time while its partitions are gathered (collectives: every rank walks it)."""
    import deepspeed
    import torch
    from peft.tuners.lora import LoraLayer

    inner = model.get_base_model()
    persistent = set(inner.state_dict(keep_vars=True))
    seen: set[int] = set()
    wrapped: str | None = None  # the LoRA layer whose children are being skipped
    layer: Any
    for prefix, module in inner.named_modules():
        if wrapped is not None and prefix.startswith(wrapped + "."):
            continue  # its base layer and adapters: already merged into one weight
        if isinstance(module, LoraLayer):
            wrapped, layer = prefix, module  # (a PEFT Linear: an nn.Module, which LoraLayer's type does not say)
            params = [p for p in layer.parameters() if hasattr(p, "ds_id")]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None), torch.no_grad():
                base = layer.get_base_layer()
                seen.update(id(p) for p in layer.parameters())
                own = [(f"{prefix}.weight", _merged_weight(layer, base))]
                if getattr(base, "bias", None) is not None:
                    own.append((f"{prefix}.bias", base.bias))
                yield own
            continue
        own = module_tensors(prefix, module, seen, persistent)
        if own:
            with deepspeed.zero.GatheredParameters([t for _, t in own if hasattr(t, "ds_id")],
                                                   modifier_rank=None), torch.no_grad():
                yield own


def _merged_weight(layer: Any, base: Any) -> "torch.Tensor":
    """`layer`'s weight with its adapter merged in, by PEFT's own rule for its variant: W + scaling·B·A for LoRA,
    DoRA's magnitude / ||W + scaling·B·A|| (per output feature) times that for DoRA; the layer is not changed."""
    variant = getattr(layer, "lora_variant", {}).get(ADAPTER_NAME)
    if variant is None:
        return base.weight + layer.get_delta_weight(ADAPTER_NAME)
    # (merge_safe keeps the weight norm for an unmerge that never comes: one vector per layer, replaced each export)
    return variant.merge_safe(layer, ADAPTER_NAME, base.weight.detach().clone())


def join_save(model: Any, lora: Lora, arch: ModelArchitecture) -> None:
    """A rank other than 0 while rank 0 runs save_adapter: the same gathers, nothing written."""
    _adapter_state(model, lora, arch)
    if lora.merge_on_save:
        for _ in _merged(model):
            pass


def save_adapter(model: Any, path: Path, *, lora: Lora, arch: ModelArchitecture, tokenizer: Any | None,
                 shard_size: int, step: int,
                 dtype: "torch.dtype", validation_loss: float | None = None, job: str = "",
                 job_uid: str = "", card: str = "") -> OutputStatus:
    """Write `model`'s adapter in PEFT format with the tokenizer and model `card` to `path` and, with
    lora.mergeOnSave, the merged model to `path`/merged, atomically (the run file last)."""
    from safetensors.torch import save_file

    check_output_path(path)  # before the gathers, as save_model does
    state = _adapter_state(model, lora, arch)
    with atomic_output(path) as tmp:
        save_file(state, str(tmp / ADAPTER), metadata={"format": "pt"})
        config = copy.copy(model.peft_config[ADAPTER_NAME])
        config.inference_mode = True  # as PEFT saves it: loaded for inference unless asked otherwise
        config.modules_to_save = lora.modules_to_save  # PEFT wraps them on load and takes their saved weights
        config.save_pretrained(str(tmp))
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        if lora.merge_on_save:
            (tmp / MERGED).mkdir()
            write_hf_model(model.get_base_model(), tmp / MERGED, groups=_merged(model), tokenizer=tokenizer,
                           shard_size=shard_size, dtype=dtype)
        if card:
            (tmp / CARD).write_text(card)
        write_run_file(tmp, job=job, job_uid=job_uid, step=step, validation_loss=validation_loss)
    files = [f for f in path.rglob("*") if f.is_file()]
    return OutputStatus(path=str(path), step=step, files=len(files),
                        bytes=sum(f.stat().st_size for f in files if f.suffix == ".safetensors"),
                        validation_loss=validation_loss)

