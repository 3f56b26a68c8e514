"""The model: a `transformers` causal LM, from a Hugging Face directory or a preset's config, built into
ZeRO-3 partitions.

One path for both: a preset becomes the `transformers` config its family declares, with random weights;
a directory's `config.json` is read as written. Either way the model is constructed under
`deepspeed.zero.Init` (through `transformers`' own ZeRO-3 integration, which for a preset also draws the
random weights on gathered parameters), so every module's parameters are partitioned - and, with
`offload_param: nvme`, swapped out - as soon as the module exists. A directory's weights are then
streamed in one safetensors shard at a time, one module's tensors at a time: each is read from the
shard (plain reads, never a mapping: memstrata.runtime.train.model.tensorfile), its partitions gathered, copied and
re-partitioned. The host never holds the whole
model, in fp32 or otherwise.
"""
from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.hfconfig import ModelConfigError, architecture_from_config, config_mismatches
from memstrata.runtime.train.model.tensorfile import TensorFile, TensorFileError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["ModelDirError", "ModelDir", "preset_config", "read_model_dir", "random_model", "build_model",
           "load_weights", "layout_mismatch"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class ModelDirError(ValueError):
    """A model directory cannot be used; the message names the path and the problem."""


@dataclass(frozen=True)
class ModelDir:
    """A checked Hugging Face model directory: its shape and, per shard file, the tensor names in it."""

    path: Path
    architecture: ModelArchitecture
    shards: dict[Path, list[str]]

    @property
    def tensor_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.shards)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelDirError(f"{path}: missing") from None
    except OSError as exc:
        raise ModelDirError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ModelDirError(f"{path}: not valid JSON: {exc}") from None


def _shard_names(path: Path) -> list[str]:
    """The tensor names of a shard whose header and size agree (a shard cut short fails here, before loading)."""
    try:
        with TensorFile(path) as f:
            return f.keys()
    except TensorFileError as exc:
        raise ModelDirError(str(exc)) from None


def read_model_dir(path: Path, declared: ModelArchitecture | None = None) -> ModelDir:
    """Check `path` before anything is built: config.json, every shard the index names, the declared shape."""
    if not path.is_dir():
        raise ModelDirError(f"spec.model.path: {path}: no such directory")
    config = _read_json(path / "config.json")
    try:
        arch = architecture_from_config(config, str(path / "config.json"))
    except ModelConfigError as exc:
        raise ModelDirError(str(exc)) from None
    if declared is not None:
        wrong = config_mismatches(declared, arch)
        if wrong:
            raise ModelDirError(f"spec.model.architecture does not match {path / 'config.json'}: " + "; ".join(wrong))
    shards: dict[Path, list[str]] = {}
    if (path / INDEX).exists():
        index = _read_json(path / INDEX)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelDirError(f"{path / INDEX}: no weight_map")
        for name in sorted(set(weight_map.values())):
            shard = path / name
            if not shard.is_file():
                raise ModelDirError(f"{shard}: missing (named by {path / INDEX})")
            shards[shard] = _shard_names(shard)
        listed = {n for names in shards.values() for n in names}
        absent = sorted(set(weight_map) - listed)
        if absent:
            raise ModelDirError(f"{path / INDEX}: names tensors its shards do not hold: {', '.join(absent[:5])}")
    elif (path / SINGLE).exists():
        shards[path / SINGLE] = _shard_names(path / SINGLE)
    else:
        found = ", ".join(sorted(p.name for p in path.glob("*.bin"))[:3])
        hint = f" (found {found}: convert PyTorch .bin weights to safetensors)" if found else ""
        raise ModelDirError(f"{path}: no {SINGLE} and no {INDEX}{hint}")
    return ModelDir(path=path, architecture=arch, shards=shards)


def preset_config(arch: ModelArchitecture, sequence_length: int) -> "PretrainedConfig":
    """The `transformers` config of a preset shape, as its family declares it (random weights are drawn at
    build time)."""
    from transformers import AutoConfig

    model_type, kwargs = arch.spec.preset_config(arch, sequence_length)
    return AutoConfig.for_model(model_type, **kwargs)


def layout_mismatch(arch: ModelArchitecture, config: "PretrainedConfig", source: str) -> str | None:
    """Why the model `config` builds is not the one memstrata planned (the tensors, in `model.parameters()` order,
    against its family's layout), or None. Built on the meta device: shapes only, no memory. A model type no family
    names is read as Llama-shaped, and a mixture of experts, a fused or extra tensor would otherwise be planned
    wrong without a word."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        # ds_numel: were a ZeRO-3 context still live in this process, its partitions would report numel() 0.
        built = [(name, getattr(p, "ds_numel", p.numel()))
                 for name, p in AutoModelForCausalLM.from_config(config).named_parameters()]
    planned = arch.tensor_sizes()
    if [n for _, n in built] == planned:
        return None
    at = next((i for i, ((_, b), a) in enumerate(zip(built, planned)) if a != b), min(len(planned), len(built)))
    where = (f"{built[at][0]}: {built[at][1]:,} elements built, {planned[at]:,} planned" if at < len(built) and
             at < len(planned) else f"tensor {at}: {'built, not planned' if at < len(built) else 'planned, not built'}")
    return (f"{source}: model_type {getattr(config, 'model_type', '?')!r} read as a {arch.spec.title} model, but "
            f"transformers builds {len(built)} tensors of {sum(n for _, n in built):,} elements where that shape "
            f"has {len(planned)} of {sum(planned):,} (first difference: {where}); memstrata cannot plan this "
            f"model's memory (its families: {', '.join(_family_names())})")


def _family_names() -> list[str]:
    from memstrata.api.families import FAMILIES

    return [f.title for f in FAMILIES.values()]


def random_model(arch: ModelArchitecture, sequence_length: int, seed: int) -> "PreTrainedModel":
    """A preset's model with seeded random weights, outside ZeRO-3 (for benchmarks and tests that hand a
    plain module to `deepspeed.initialize`, and for building on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(preset_config(arch, sequence_length))


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Build without drawing random weights: a checkpoint overwrites every parameter, and under ZeRO-3
    `transformers`' initialisation gathers (with NVMe offload: reads and writes back) every module once more
    for nothing. (transformers 5.23 calls `initialize_weights_zero3` from its integration module by name.)"""
    import transformers.integrations.deepspeed as hf_deepspeed
    from transformers.initialization import no_init_weights

    saved = hf_deepspeed.initialize_weights_zero3
    hf_deepspeed.initialize_weights_zero3 = lambda model: None
    try:
        with no_init_weights():
            yield
    finally:
        hf_deepspeed.initialize_weights_zero3 = saved


def build_model(config: "PretrainedConfig", ds_config: dict[str, Any], dtype: "torch.dtype", *,
                checkpointing: bool, seed: int, pretrained: ModelDir | None = None,
                checkpoint_function: Callable[..., Any] | None = None) -> "PreTrainedModel":
    """The model under ZeRO-3, constructed partition by partition; random weights unless `pretrained` (whose
    weights `load_weights` then streams in, and whose generation config the model takes). The caller keeps
    the returned model's `hf_deepspeed_config` alive: `transformers` checks it (through a weak reference)
    whenever it touches parameters. `checkpoint_function`: what each checkpointed layer runs through instead
    of torch's checkpoint (memstrata.runtime.swap.activations: the checkpoints leave the device)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(ds_config)
    torch.manual_seed(seed)
    config.use_cache = False  # no KV cache in training; it only costs memory
    with _no_random_init() if pretrained is not None else contextlib.nullcontext():
        # sdpa: memory-efficient attention (no s x s score matrix), on the GPU and on the CPU alike.
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if pretrained is not None and (pretrained.path / "generation_config.json").is_file():
        # The source's stop tokens and sampling defaults (e.g. Llama-3-Instruct's <|eot_id|>), which a
        # generation config derived from config.json would lose.
        model.generation_config = GenerationConfig.from_pretrained(pretrained.path)
    model.hf_deepspeed_config = keep
    swapper = next((p.nvme_swapper for p in model.parameters() if getattr(p, "nvme_swapper", None)), None)
    if swapper is not None and hasattr(swapper, "forget_except"):
        # Tied weights: the LM head's own weight was built (and swapped out) before it was replaced.
        swapper.forget_except({p.ds_id for p in model.parameters()})
    if checkpointing:
        # Non-reentrant: the reentrant variant drops gradients of inputs that do not require them.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if checkpoint_function is not None:
            model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint_function)
    return model


def _module_groups(names: list[str]) -> Iterator[list[str]]:
    """The shard's tensor names grouped by owning module, in order: gathering a module's parameters at once
    costs one module's memory, never the shard's."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in names:
        groups[name.rpartition(".")[0]].append(name)
    yield from groups.values()


def _resolve(name: str, params: dict[str, Any], prefix: str) -> str | None:
    """The model's parameter name for a checkpoint tensor name (checkpoints saved from the base model lack
    the task model's prefix, e.g. GPT-2's `h.0...` for `transformer.h.0...`)."""
    if name in params:
        return name
    if prefix and f"{prefix}.{name}" in params:
        return f"{prefix}.{name}"
    return None


def load_weights(model: "PreTrainedModel", model_dir: ModelDir) -> None:
    """Copy every checkpoint tensor into its ZeRO-3 partitions, one module at a time. A parameter the
    checkpoint lacks, or a shape that differs, fails with both named; buffers (e.g. rotary frequencies)
    are recomputed, not loaded; a shard cut short or gone while it is read fails naming it. A model built with
    a larger vocabulary (model.addedTokens) takes the checkpoint's rows of its vocabulary-sized tensors, and
    each new row starts at the mean of those (transformers' resize_token_embeddings does the same)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    vocab = model_dir.architecture.vocab
    for shard, names in model_dir.shards.items():
        try:
            with TensorFile(shard) as f:
                loaded |= _load_shard(f, names, params, getattr(model, "base_model_prefix", ""), vocab)
        except TensorFileError as exc:
            raise ModelDirError(str(exc)) from None
    tied = {id(p) for n, p in params.items() if n in loaded}
    missing = sorted(n for n, p in params.items() if n not in loaded and id(p) not in tied)
    if missing:
        raise ModelDirError(f"{model_dir.path}: the checkpoint has no weights for {len(missing)} parameter(s) of "
                            f"the model: {', '.join(missing[:5])}")


def _load_shard(f: TensorFile, names: list[str], params: dict[str, Any], prefix: str, vocab: int) -> set[str]:
    """The model's parameters `f`'s tensors `names` were copied into (`vocab`: the checkpoint's vocabulary)."""
    import deepspeed
    import torch

    loaded: set[str] = set()
    for group in _module_groups(names):
        targets = {n: t for n in group if (t := _resolve(n, params, prefix)) is not None}
        if not targets:
            continue  # buffers such as attn.bias masks of old GPT-2 checkpoints
        owned = [params[t] for t in targets.values()]
        with deepspeed.zero.GatheredParameters(owned, modifier_rank=0), torch.no_grad():
            for name, target in targets.items():
                tensor = f.get_tensor(name)
                param = params[target]
                if _grown(tensor.shape, param.shape, vocab):
                    param[:vocab].copy_(tensor)
                    param[vocab:].copy_(tensor.float().mean(0).expand_as(param[vocab:]))
                elif tuple(tensor.shape) != tuple(param.shape):
                    raise ModelDirError(f"{f.path}: {name} has shape {tuple(tensor.shape)}, the model's "
                                        f"{target} is {tuple(param.shape)}")
                else:
                    param.copy_(tensor)  # converts the dtype in place: no second host copy
                loaded.add(target)
                del tensor
    return loaded


def _grown(stored: Any, built: Any, vocab: int) -> bool:
    """Whether a stored vocabulary-sized tensor (`vocab` rows) fills the first rows of a grown parameter."""
    return len(stored) >= 1 and stored[0] == vocab and built[0] > vocab and tuple(stored[1:]) == tuple(built[1:])
