"""What a run checks before it writes a byte: the recipe's `__init__` (torchtune style: conflicting settings are
rejected early), in parts that take explicit arguments and return what they read.

Every input is checked here: a bad model directory, tokenizer, dataset, output path, checkpoint path, LoRA
setting or device fails in seconds, not after the model was built. Each failure is a RecipeError whose message
names the field and why.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.checkpoint import run_fingerprint
from memstrata.api.finetunejob import FineTuneJobSpec, Training
from memstrata.api.jobstatus import OutputStatus
from memstrata.api.lora import Lora
from memstrata.api.strataplan import Engine, Plan
from memstrata.runtime.train.data.tokenizer import ByteTokenizer, Tokenizer, add_tokens, load_tokenizer, use_chat_template
from memstrata.runtime.train.checkpoints.checkpoint import CheckpointError, Checkpointer, Found
from memstrata.runtime.train.model.export import OutputPathError, check_output_path, finished_output
from memstrata.runtime.train.model.hfmodel import ModelDir, ModelDirError, read_model_dir
from memstrata.runtime.train.launch import LaunchError, Ranks
from memstrata.runtime.train.observe.metrics import MetricsError, check_metrics_dir

__all__ = ["RecipeError", "accelerator_env", "check_adapter", "checkpoints", "engine_of", "hf_config",
           "job_tokenizer", "loss_chunk_tokens", "on_gpu_for", "rank_of", "read_model", "read_output",
           "visible_gpus"]


class RecipeError(ValueError):
    """The job cannot run locally as written; the message names the field and why."""


def engine_of(spec: FineTuneJobSpec, plan: Plan) -> Engine:
    """The engine the run uses: its plan's (api.strataplan, the choice's one home), which must be the one the job
    asks for."""
    if plan.engine != spec.memory.engine:
        raise RecipeError(f"plan.engine: the plan was made for {plan.engine!r}, but spec.memory.engine is "
                          f"{spec.memory.engine!r}: plan the job again")
    return plan.engine


def rank_of(spec: FineTuneJobSpec) -> Ranks:
    """This process's place among the job's ranks, as the launcher set it (or a world of one)."""
    try:
        ranks = Ranks.from_env()
    except LaunchError as exc:
        raise RecipeError(str(exc)) from None
    if ranks.world != spec.resources.world_size() and "WORLD_SIZE" in os.environ:
        raise RecipeError(f"spec.resources: nodes {spec.resources.nodes} x {spec.resources.ranks()} ranks per node "
                          f"is a world of {spec.resources.world_size()}, but this process was started as rank "
                          f"{ranks.rank} of {ranks.world} (WORLD_SIZE)")
    return ranks


def read_model(spec: FineTuneJobSpec) -> ModelDir | None:
    """The model directory, or None for a preset."""
    try:
        return read_model_dir(Path(spec.model.path), spec.model.architecture) if spec.model.path is not None else None
    except ModelDirError as exc:
        raise RecipeError(str(exc)) from None


def read_output(spec: FineTuneJobSpec, *, job: str, job_uid: str, resume: bool) -> OutputStatus | None:
    """The job's saved model when a retry finds it already written; else the output path must be free."""
    try:
        # A retry of a job that saved its model and died before it could report so is finished, not refused.
        finished = (finished_output(Path(spec.output.path), job=job, job_uid=job_uid, steps=spec.training.steps)
                    if spec.output is not None and resume else None)
        if spec.output is not None and finished is None:
            check_output_path(Path(spec.output.path))
            check_metrics_dir(Path(spec.output.metrics_dir()))
    except (OutputPathError, MetricsError) as exc:
        raise RecipeError(str(exc)) from None
    return finished


def checkpoints(spec: FineTuneJobSpec, *, job: str, job_uid: str, arch: ModelArchitecture, engine: Engine,
                resume: bool, expected: int | None) -> tuple[Checkpointer | None, Found | None]:
    """(the job's checkpointer, the checkpoint this run resumes from): None, None without spec.checkpoint."""
    if spec.checkpoint is None:
        return None, None
    checkpointer = Checkpointer(spec.checkpoint, job=job, job_uid=job_uid, arch=arch,
                                precision=spec.training.precision, engine_name=engine,
                                fingerprint=run_fingerprint(spec.training, spec.dataset))
    try:
        checkpointer.check_path()
        return checkpointer, checkpointer.to_resume(resume=resume, steps=spec.training.steps, expected_step=expected)
    except CheckpointError as exc:
        raise RecipeError(str(exc)) from None


def job_tokenizer(spec: FineTuneJobSpec, model_dir: ModelDir | None, arch: ModelArchitecture) -> Tokenizer:
    """The model directory's tokenizer (the byte tokenizer for a preset), with the spec's chat template and
    added tokens."""
    tokenizer: Tokenizer = load_tokenizer(model_dir.path, arch.vocab) if model_dir is not None else ByteTokenizer()
    if spec.dataset.chat_template is not None:
        use_chat_template(tokenizer, spec.dataset.chat_template)
    if spec.model.added_tokens:
        add_tokens(tokenizer, spec.model.added_tokens, rows=arch.vocab - len(spec.model.added_tokens))
    if model_dir is None and arch.vocab < ByteTokenizer.VOCAB:
        raise RecipeError(f"spec.model: vocabulary of {arch.vocab} tokens is smaller than the byte tokenizer's "
                          f"{ByteTokenizer.VOCAB}")
    return tokenizer


def hf_config(model_dir: ModelDir | None) -> Any:
    """The model directory's transformers config (None for a preset)."""
    if model_dir is None:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir.path, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:  # an unknown model_type, a config transformers refuses
        raise RecipeError(f"{model_dir.path / 'config.json'}: transformers cannot build this model: {exc}") from None


def check_adapter(spec: FineTuneJobSpec, config: Any, arch: ModelArchitecture, *, preset: bool) -> Lora | None:
    """LoRA's settings (None: a full fine-tune), checked against the model it adapts."""
    adapter = spec.training.adapter()
    if adapter is None:
        return None
    from memstrata.runtime.train.model.hfmodel import preset_config
    from memstrata.runtime.train.model.lora import LoraError, check_lora

    try:
        check_lora(config or preset_config(arch, spec.training.sequence_length), adapter, arch, preset=preset,
                   output=spec.output is not None)
    except LoraError as exc:
        raise RecipeError(str(exc)) from None
    return adapter


def loss_chunk_tokens(training: Training, config: Any) -> int:
    """spec.training.lossChunkTokens, unless the model's own loss (`config`: its transformers config) is more than
    the LM head's cross-entropy: then the default quietly computes the logits whole (with a warning), and a value
    the job set is refused."""
    if not training.loss_chunk_tokens or config is None:
        return training.loss_chunk_tokens
    from memstrata.runtime.train.model.loss import chunked_loss_refusal

    why = chunked_loss_refusal(config)
    if why is None:
        return training.loss_chunk_tokens
    if "loss_chunk_tokens" in training.model_fields_set:
        raise RecipeError(f"spec.training.lossChunkTokens: {why}: set lossChunkTokens: 0")
    logging.getLogger(__name__).warning("memstrata: %s: the loss is computed over whole logits (lossChunkTokens 0)",
                                        why)
    return 0


def runs_layer_major(training: Training, plan: Plan, chunk_tokens: int) -> bool:
    """Whether the runtime runs the step's micro-batches layer-major: where the plan says so and the loss is chunked
    (`chunk_tokens`, which `loss_chunk_tokens` turns to 0 for a model whose own loss is more than the head's: then a
    job that asked for layer-major is refused, and the planner's choice quietly dropped)."""
    if not plan.layer_major:
        return False
    if chunk_tokens:
        return True
    if training.layer_major:
        raise RecipeError("spec.training.layerMajor: this model's loss cannot be taken chunk by chunk, so its "
                          "micro-batches' losses cannot be taken apart: set layerMajor: false")
    logging.getLogger(__name__).warning("memstrata: the micro-batches run one after the other (not layer-major): "
                                        "this model's loss is computed over whole logits")
    return False


def visible_gpus() -> int:
    """The CUDA devices torch sees here (CUDA_VISIBLE_DEVICES and the container's devices applied). Asked of torch,
    not of the driver's /proc files: a container can be handed a GPU without them."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def on_gpu_for(gpus: int, visible: Callable[[], int] = visible_gpus) -> bool:
    """Whether a job asking for `gpus` GPUs (spec.resources.gpus) trains on them here: never silently on the CPU
    instead. RecipeError naming the field when this process sees none. (Each rank takes cuda:LOCAL_RANK; a rank
    beyond the GPUs it sees fails there, naming its device.)"""
    if gpus < 1:
        return False
    seen = visible()
    if seen < 1:
        raise RecipeError(f"spec.resources.gpus: the job asks for {gpus} GPU(s) and this process sees none (torch "
                          f"finds no CUDA device: no NVIDIA driver, a CUDA_VISIBLE_DEVICES that hides them, or a "
                          f"container not given the GPU); set gpus: 0 to train on the CPU")
    return True


def accelerator_env(on_gpu: bool, env: dict[str, str] | Any = os.environ) -> str:
    """Set DS_ACCELERATOR to the run's device before DeepSpeed is imported (it picks its accelerator then, once per
    process): an inherited value that says otherwise would put a GPU run's DeepSpeed on the CPU, or the reverse.
    RecipeError when DeepSpeed was already set up in this process for another accelerator."""
    wanted = "cuda" if on_gpu else "cpu"
    env["DS_ACCELERATOR"] = wanted
    loaded = sys.modules.get("deepspeed.accelerator.real_accelerator")
    chosen = getattr(loaded, "ds_accelerator", None) if loaded is not None else None
    name = chosen.device_name() if chosen is not None else wanted
    if name != wanted:
        raise RecipeError(f"DS_ACCELERATOR: DeepSpeed was already set up in this process for {name!r}, but this run "
                          f"trains on {wanted!r} (spec.resources.gpus); start it in a new process")
    return wanted
