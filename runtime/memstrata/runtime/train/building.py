"""What the recipe's `setup` builds, in dependency order (torchtune's `_setup_*`: explicit arguments in, what they
build out): the process group, then the model, straight into its ZeRO-3 partitions (and into memstrata's strata
when the plan runs memstrata's engine), then the DeepSpeed engine around it."""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.finetunejob import Precision, Training
from memstrata.api.lora import Lora
from memstrata.runtime.swap.layer import SwapSettings
from memstrata.runtime.swap.protocols import TrainingEngine
from memstrata.runtime.train.dsconfig import DsConfig
from memstrata.runtime.train.model.hfmodel import ModelDir
from memstrata.runtime.train.preflight import RecipeError, accelerator_env
from memstrata.runtime.train.schedule import build_scheduler

if TYPE_CHECKING:
    import torch

__all__ = ["build_engine", "no_compile", "setup_distributed", "torch_dtype"]


def setup_distributed(on_gpu: bool, local_rank: int) -> None:
    """torch.distributed as the launcher set it up, or, alone, a world of one set up the way it would. Alone, its
    store listens on port 0, which the kernel resolves when it binds: a port found free beforehand (`free_port`) could
    be taken in between by any other process's connection (EADDRINUSE failed a run of `make test` so)."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "0")):
        os.environ.setdefault(key, value)
    accelerator_env(on_gpu)
    if on_gpu:
        import torch

        torch.cuda.set_device(local_rank)  # one GPU per rank: cuda:LOCAL_RANK
    import deepspeed  # noqa: F401  (its loggers exist once imported, so the levels set below stick)

    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # torch 2.13 warns on every step that ZeRO-3 calls the old collective names; once is noise enough.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    from memstrata.runtime.swap.integration import init_distributed

    init_distributed("nccl" if on_gpu else "gloo")


def torch_dtype(precision: Precision) -> "torch.dtype":
    """The torch dtype of the job's precision: the model is built, trained and saved in it."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def build_engine(ds: DsConfig, training: Training, arch: ModelArchitecture, *, dtype: "torch.dtype", hf_config: Any,
                 model_dir: ModelDir | None, swap: SwapSettings | None, loss_chunk_tokens: int,
                 adapter: Lora | None, built: Callable[[Any], None]) -> TrainingEngine:
    """The DeepSpeed engine. `swap`: memstrata's swap layer's settings (None: stock ZeRO-Infinity); `built` gets
    the transformers model as soon as it exists, before the engine (a failed initialize leaves it to clean up)."""
    from memstrata.runtime.train.model.hfmodel import build_model, layout_mismatch, load_weights, preset_config
    from memstrata.runtime.train.model.lora import add_adapters

    t = training
    config = hf_config if hf_config is not None else preset_config(arch, t.sequence_length)
    if model_dir is not None:  # a preset's layout is its family's by construction (tests/runtime)
        wrong = layout_mismatch(arch, config, str(model_dir.path / "config.json"))
        if wrong:
            raise RecipeError(wrong)
    layer, handed = None, False
    if swap is not None:
        from memstrata.runtime.swap.integration import constructing, open_layer

        # Opened before the model exists, so the model is built straight into memstrata's strata. The plan named
        # them (swap_settings), so the layer needs nothing from DeepSpeed's config.
        layer = open_layer(None, swap, numel=arch.parameters())
    try:
        with constructing(layer) if layer is not None else contextlib.nullcontext():
            # memstrata's engine moves each activation checkpoint to the stratum the plan gave them.
            offload = (layer.activation_offload().checkpoint if layer is not None and t.activation_checkpointing
                       else None)
            model = build_model(config, ds.config, dtype, checkpointing=t.activation_checkpointing, seed=t.seed,
                                pretrained=model_dir, checkpoint_function=offload)
            if model_dir is not None:
                load_weights(model, model_dir)
        if loss_chunk_tokens:
            from memstrata.runtime.train.model.loss import install_chunked_loss

            try:
                install_chunked_loss(model, loss_chunk_tokens)
            except ValueError as exc:
                raise RecipeError(str(exc)) from None
        if adapter is not None:
            model = add_adapters(model, adapter, arch, seed=t.seed)
        if t.neftune_noise_alpha is not None:
            from memstrata.runtime.train.model.neftune import install_neftune

            install_neftune(model, t.neftune_noise_alpha)
        built(model)
        handed = layer is not None  # from here on, initialize closes the layer if it fails
        engine = _initialize(model, ds, t, layer)
        if adapter is not None and adapter.use_dora:
            from memstrata.runtime.train.model.lora import gather_for_dora

            gather_for_dora(engine.module)
        return engine
    except BaseException:
        if layer is not None and not handed:
            layer.close()
        raise


def _initialize(model: Any, ds: DsConfig, training: Training, layer: Any) -> TrainingEngine:
    """deepspeed.initialize, or memstrata's with `layer` (which then closes the layer if it fails)."""
    import functools

    import deepspeed

    groups = param_groups(model, training.optimizer.weight_decay)
    # DeepSpeed calls this with its basic optimizer, steps the scheduler after every applied optimizer step and
    # keeps it as engine.lr_scheduler (saved in its checkpoints).
    scheduler = functools.partial(build_scheduler, training=training)
    if layer is None:
        from memstrata.runtime.swap.cpufacts import cpu_info_answered

        with cpu_info_answered(), no_compile():
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds.config,
                                                   lr_scheduler=scheduler)
        return engine
    from memstrata.runtime.swap.integration import initialize

    with no_compile():
        engine, _, _, _ = initialize(model=model, model_parameters=groups, config=ds.config,
                                     lr_scheduler=scheduler, layer=layer)
    return engine


@contextlib.contextmanager
def no_compile() -> Iterator[None]:
    """TORCHDYNAMO_DISABLE=1 for the duration, unless the environment already says otherwise; then as it was.
    The recipe compiles nothing (attention is sdpa; the update is DeepSpeed's CPU Adam or memstrata's own loop), yet
    DeepSpeed's ZeRO sanity check, inside `initialize`, imports its Muon module, whose kernel is `@torch.compile`d
    at import, and that loads torch's inductor: 0.8 s of CPU at every rank's start. torch.compile reads the variable
    at each call (a compiled function is then returned as it is), so only what runs inside is affected: the
    drop-in `memstrata.runtime.initialize` called by a user, and the user's own torch.compile, are not."""
    if "TORCHDYNAMO_DISABLE" in os.environ:
        yield
        return
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        yield
    finally:
        del os.environ["TORCHDYNAMO_DISABLE"]


def param_groups(model: Any, weight_decay: float) -> list[Any]:
    """What the optimizer is given: the trainable parameters, and with weight decay in two groups, the biases and
    norm scales (every parameter of fewer than two dimensions) not decayed, as transformers' Trainer and TRL do.
    Without decay, one group: the layout earlier checkpoints have. Shapes are ZeRO-3's `ds_shape`: a partitioned
    parameter's own tensor is empty."""
    from memstrata.runtime.train.model.lora import trainable

    params = trainable(model)
    if not weight_decay:
        return params
    flat = [p for p in params if len(getattr(p, "ds_shape", p.shape)) < 2]
    if not flat:
        return params
    kept = {id(p) for p in flat}
    return [{"params": [p for p in params if id(p) not in kept]}, {"params": flat, "weight_decay": 0.0}]
