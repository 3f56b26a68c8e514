"""The local fine-tuning recipe: DeepSpeed ZeRO-3 on stock ZeRO-Infinity (`memory.engine: deepspeed`) or
with memstrata's swap layer in its place (`memory.engine: memstrata`).

Read it in order, torchtune style: `__init__` rejects settings that cannot run
here (before anything is written): the model directory, the tokenizer, the
dataset and the output path are all checked there; `setup` builds the swap
directory, the model (straight into its ZeRO-3 partitions, weights streamed in)
and the DeepSpeed engine, in dependency order; `train` is one linear loop with
validation; `save` writes the fine-tuned model; `cleanup` tears down the
process group and removes the swap directory. Gloo on the CPU, NCCL on a GPU.

One process is one rank. Alone (world size 1) it sets up its own process group;
started by a launcher (memstrata.runtime.train.launch: torch elastic, which
sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT) it is one of `Ranks.world`: it trains on its own share of the
micro-batches (memstrata.runtime.train.data, the module doc), on cuda:LOCAL_RANK
on a GPU node, with a swap directory and DRAM cache slice of its own, and every
number it reports (loss, tokens, validation loss) is the whole world's.
"""
from __future__ import annotations

import logging
import os
import shutil
import warnings
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from memstrata.api.finetunejob import FineTuneJob, OutputStatus
from memstrata.api.inventory import ENV_NVME_DEVICES
from memstrata.api.strataplan import Plan
from memstrata.api.checkpoint import run_fingerprint
from memstrata.runtime.train.checkpoint import CheckpointError, Checkpointer, CheckpointWriteError, Found, Resumed
from memstrata.runtime.train.data import ByteTokenizer, TrainData, build_data, load_tokenizer
from memstrata.runtime.train.export import OutputPathError, check_output_path, finished_output, reclaim_partials
from memstrata.runtime.train.metrics import MetricsError, StepResult, check_metrics_dir
from memstrata.runtime.train.hfmodel import ModelDir, ModelDirError, read_model_dir
from memstrata.runtime.train.launch import LaunchError, Ranks, free_port, world_sum
from memstrata.runtime.train.owner import Ownership, own, reclaim
from memstrata.runtime.train.device import PhaseClock, hbm_peak_bytes, synchronizer
from memstrata.runtime.train.dsconfig import DsConfig, build_ds_config, deepspeed_swap_refusal
from memstrata.runtime.train.schedule import build_scheduler
from memstrata.runtime.swap.protocols import TrainingEngine
from memstrata.runtime.swap.layer import bound_host_heap
from memstrata.runtime.swap.status import SwapStatus
from memstrata.runtime.swap.stratamap import SwapStrata, create_file_namespaces, swap_settings


if TYPE_CHECKING:
    import torch

SWAP_DIR_PREFIX = "memstrata-run-"  # a run's scratch directory under the NVMe path (one per run and rank)


class RecipeError(ValueError):
    """The job cannot run locally as written; the message names the field and why."""


@dataclass
class Phases:
    """Wall-clock seconds spent in each phase of the run."""

    init: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    step: float = 0.0
    save: float = 0.0


@dataclass
class TrainResult:
    steps: list[StepResult] = field(default_factory=list)
    phases: Phases = field(default_factory=Phases)
    validation_losses: dict[int, float] = field(default_factory=dict)  # step (0: before training) -> loss


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
    import sys

    wanted = "cuda" if on_gpu else "cpu"
    env["DS_ACCELERATOR"] = wanted
    loaded = sys.modules.get("deepspeed.accelerator.real_accelerator")
    chosen = getattr(loaded, "ds_accelerator", None) if loaded is not None else None
    name = chosen.device_name() if chosen is not None else wanted
    if name != wanted:
        raise RecipeError(f"DS_ACCELERATOR: DeepSpeed was already set up in this process for {name!r}, but this run "
                          f"trains on {wanted!r} (spec.resources.gpus); start it in a new process")
    return wanted


class FineTuneRecipe:
    def __init__(self, job: FineTuneJob, plan: Plan, nvme_path: Path, *, resume: bool = False,
                 job_uid: str = "", expected_checkpoint: int | None = None) -> None:
        """`resume`: continue from the newest intact checkpoint under spec.checkpoint.path when there is one
        (without it, existing checkpoints are refused rather than overwritten); `job_uid`: the FineTuneJob's
        uid, which a checkpoint must share; `expected_checkpoint`: the newest checkpoint step the job's status
        reported, which must still be there."""
        spec = self.spec = job.spec
        self.job, self.plan = job, plan
        # The engine's home is the plan (api.strataplan): the run is the one its bytes were counted for.
        self.engine_name = plan.engine
        if plan.engine != spec.memory.engine:
            raise RecipeError(f"plan.engine: the plan was made for {plan.engine!r}, but spec.memory.engine is "
                              f"{spec.memory.engine!r}: plan the job again")
        try:
            self.ranks = Ranks.from_env()
        except LaunchError as exc:
            raise RecipeError(str(exc)) from None
        if self.ranks.world != spec.resources.world_size() and "WORLD_SIZE" in os.environ:
            raise RecipeError(f"spec.resources: nodes {spec.resources.nodes} x {spec.resources.ranks()} ranks per node "
                              f"is a world of {spec.resources.world_size()}, but this process was started as rank "
                              f"{self.ranks.rank} of {self.ranks.world} (WORLD_SIZE)")
        # Every input is checked here, before a byte is written: a bad model directory, tokenizer, dataset or
        # output path fails in seconds, not after the model was built.
        self.model_dir: ModelDir | None = None
        self.job_uid = job_uid
        try:
            if spec.model.path is not None:
                self.model_dir = read_model_dir(Path(spec.model.path), spec.model.architecture)
            # A retry of a job that saved its model and died before it could report so is finished, not refused.
            self.finished = (finished_output(Path(spec.output.path), job=job.metadata.name, job_uid=job_uid,
                                             steps=spec.training.steps)
                             if spec.output is not None and resume else None)
            if spec.output is not None and self.finished is None:
                check_output_path(Path(spec.output.path))
                check_metrics_dir(Path(spec.output.metrics_dir()))
        except (ModelDirError, OutputPathError, MetricsError) as exc:
            raise RecipeError(str(exc)) from None
        self.arch = self.model_dir.architecture if self.model_dir is not None else spec.model.shape()
        self.checkpointer: Checkpointer | None = None
        self.found: Found | None = None  # the checkpoint this run resumes from
        self.resumed: Resumed | None = None
        if spec.checkpoint is not None:
            self.checkpointer = Checkpointer(spec.checkpoint, job=job.metadata.name, job_uid=job_uid, arch=self.arch,
                                             precision=spec.training.precision, engine_name=self.engine_name,
                                             fingerprint=run_fingerprint(spec.training, spec.dataset))
            try:
                self.checkpointer.check_path()
                self.found = self.checkpointer.to_resume(resume=resume, steps=spec.training.steps,
                                                         expected_step=expected_checkpoint)
            except CheckpointError as exc:
                raise RecipeError(str(exc)) from None
        self.hf_config: Any = None
        if self.model_dir is not None:
            from transformers import AutoConfig

            try:
                self.hf_config = AutoConfig.from_pretrained(self.model_dir.path, local_files_only=True)
            except (ValueError, KeyError, OSError) as exc:  # an unknown model_type, a config transformers refuses
                raise RecipeError(f"{self.model_dir.path / 'config.json'}: transformers cannot build this model: "
                                  f"{exc}") from None
        self.loss_chunk_tokens = self._loss_chunk_tokens()
        self.adapter = spec.training.adapter()  # LoRA's settings (None: a full fine-tune)
        if self.adapter is not None:
            from memstrata.runtime.train.hfmodel import preset_config
            from memstrata.runtime.train.lora import LoraError, check_lora

            try:
                check_lora(self.hf_config or preset_config(self.arch, spec.training.sequence_length), self.adapter,
                           self.arch, preset=self.model_dir is None, output=spec.output is not None)
            except LoraError as exc:
                raise RecipeError(str(exc)) from None
        self.tokenizer = (load_tokenizer(self.model_dir.path, self.arch.vocab) if self.model_dir is not None
                          else ByteTokenizer())
        if self.model_dir is None and self.arch.vocab < ByteTokenizer.VOCAB:
            raise RecipeError(f"spec.model: vocabulary of {self.arch.vocab} tokens is smaller than the byte "
                              f"tokenizer's {ByteTokenizer.VOCAB}")
        self.on_gpu = on_gpu_for(spec.resources.gpus)
        # One directory per run and rank under the scratch path (the pid is the rank's own), so parallel runs and
        # the ranks of one run never share swap files.
        self.swap_owner: Ownership | None = None
        self.swap_dir = nvme_path / (f"{SWAP_DIR_PREFIX}{job.metadata.name}-{os.getpid()}-{int(time.time())}"
                                     + (f"-rank{self.ranks.rank}" if self.ranks.world > 1 else ""))
        # With memstrata, DeepSpeed's own swap folder must stay empty (no silent fallback to the stock
        # path), so it is a subfolder of its own, apart from memstrata's file-backed namespaces.
        self.ds_swap_dir = self.swap_dir / "deepspeed" if self.engine_name == "memstrata" else self.swap_dir
        # Namespaces a device plugin granted are the NVMe stratum; stock DeepSpeed cannot write them and
        # would silently swap to the scratch directory instead. (`memstrata pod` also refuses its root filesystem.)
        granted = [p.strip() for p in os.environ.get(ENV_NVME_DEVICES, "").split(",") if p.strip()]
        refusal = deepspeed_swap_refusal(plan, granted=granted, swap_dir=self.ds_swap_dir, swap_dir_on_root=False)
        if refusal is not None:
            raise RecipeError(refusal)
        self.strata: SwapStrata | None = None
        self.swap_status: SwapStatus | None = None  # memstrata's per-stratum counters, kept past cleanup
        self.data: TrainData | None = None
        self.output: OutputStatus | None = None
        self.model: Any = None  # the transformers model inside the engine
        self.ds: DsConfig | None = None
        self.engine: TrainingEngine | None = None
        self.phases = Phases()
        self.hbm_peak_bytes = 0  # the device memory held at its peak so far (GPU runs; memstrata.runtime.train.device)

    # --- setup ------------------------------------------------------------------------------------
    def _reclaim(self) -> None:
        """Remove the scratch directories and partial outputs of runs that died without cleaning up (never a
        live run's: memstrata.runtime.train.owner)."""
        out = self.spec.output
        left = reclaim(self.swap_dir.parent, SWAP_DIR_PREFIX) + (reclaim_partials(Path(out.path)) if out else [])
        for path in left:
            logging.getLogger(__name__).warning("memstrata: removed %s, left by a run that was killed", path)

    def load_data(self) -> None:
        """Read and validate the dataset; a bad file fails here, before anything is written."""
        if self.data is None:
            self.data = self._setup_data()

    def setup(self) -> None:
        t0 = time.perf_counter()
        bound_host_heap()  # before the model exists: the heap then holds only what the plan counts
        self.load_data()
        self.ds = build_ds_config(self.plan, self.arch, self.spec.training, self.ds_swap_dir, self.on_gpu,
                                  world=self.ranks.world)
        if self.engine_name == "memstrata":
            try:
                # The plan's bytes size the DRAM cache and the namespaces of the node; its ranks share them.
                self.strata = swap_settings(self.plan, self.arch, job=self.job.metadata.name, run_dir=self.swap_dir,
                                            env=os.environ)
            except ValueError as exc:
                raise RecipeError(str(exc)) from None
        self._reclaim()
        self.swap_dir.parent.mkdir(parents=True, exist_ok=True)
        self.swap_owner = own(self.swap_dir)  # a run killed before its cleanup leaves it to the next one to remove
        self.swap_dir.mkdir(exist_ok=False)
        self.ds_swap_dir.mkdir(exist_ok=True)
        if self.strata is not None:
            create_file_namespaces(self.strata)
        self._setup_distributed()
        self._agree_on_resuming()
        self.engine = self._setup_engine(self.ds)
        if self.checkpointer is not None and self.found is not None:
            try:
                self.resumed = self.checkpointer.resume(self.engine, self.found)
            except CheckpointError as exc:
                raise RecipeError(str(exc)) from None
        self.phases.init = time.perf_counter() - t0

    def _agree_on_resuming(self) -> None:
        """Every rank resumes or none does: each looked for checkpoints on its own (before the process group
        existed), and a rank that starts afresh while another resumes would meet it in different collectives."""
        if self.checkpointer is None or self.ranks.world == 1:
            return
        from memstrata.runtime.train.ckptgroup import Group

        found = Group().gather(self.found is not None)
        if any(found) and not all(found):
            having = [r for r, f in enumerate(found) if f]
            raise RecipeError(f"spec.checkpoint.path: {self.checkpointer.root}: ranks {having} found checkpoints "
                              f"there and ranks {[r for r, f in enumerate(found) if not f]} none: every node must "
                              "mount the same volume at that path (a ReadWriteMany claim), and no earlier attempt "
                              "may still be writing to it")

    def _setup_data(self) -> TrainData:
        return build_data(self.spec.dataset, self.spec.training, self.tokenizer)

    def _setup_distributed(self) -> None:
        """torch.distributed as the launcher set it up, or, alone, a world of one set up the way it would."""
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
            os.environ.setdefault(key, value)
        accelerator_env(self.on_gpu)
        if self.on_gpu:
            import torch

            torch.cuda.set_device(self.ranks.local_rank)  # one GPU per rank: cuda:LOCAL_RANK
        import deepspeed

        for name in ("DeepSpeed", "deepspeed"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # torch 2.13 warns on every step that ZeRO-3 calls the old collective names; once is noise enough.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
        deepspeed.init_distributed(dist_backend="nccl" if self.on_gpu else "gloo", verbose=False)

    def _dtype(self) -> "torch.dtype":
        """The torch dtype of the job's precision: the model is built, trained and saved in it."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.spec.training.precision]

    def _setup_engine(self, ds: DsConfig) -> TrainingEngine:
        import contextlib
        import functools

        import deepspeed

        from memstrata.runtime.train.hfmodel import build_model, load_weights, preset_config
        from memstrata.runtime.train.lora import add_adapters, trainable
        from memstrata.runtime.train.loss import install_chunked_loss

        t = self.spec.training
        dtype = self._dtype()
        config = self.hf_config if self.hf_config is not None else preset_config(self.arch, t.sequence_length)
        layer, handed = None, False
        if self.strata is not None:
            from memstrata.runtime.swap.integration import constructing, open_layer

            # Opened before the model exists, so the model is built straight into memstrata's strata. The plan named
            # them (swap_settings), so the layer needs nothing from DeepSpeed's config.
            layer = open_layer(None, self.strata.settings, numel=self.arch.parameters())
        try:
            with constructing(layer) if layer is not None else contextlib.nullcontext():
                # memstrata's engine moves each activation checkpoint to the stratum the plan gave them.
                offload = (layer.activation_offload().checkpoint
                           if layer is not None and t.activation_checkpointing else None)
                model = build_model(config, ds.config, dtype, checkpointing=t.activation_checkpointing, seed=t.seed,
                                    pretrained=self.model_dir, checkpoint_function=offload)
                if self.model_dir is not None:
                    load_weights(model, self.model_dir)
            if self.loss_chunk_tokens:
                try:
                    install_chunked_loss(model, self.loss_chunk_tokens)
                except ValueError as exc:
                    raise RecipeError(str(exc)) from None
            if self.adapter is not None:
                model = add_adapters(model, self.adapter, self.arch.family, seed=t.seed)
            self.model = model
            # DeepSpeed calls this with its basic optimizer, steps the scheduler after every applied optimizer
            # step and keeps it as engine.lr_scheduler (saved in its checkpoints).
            scheduler = functools.partial(build_scheduler, training=t)
            if layer is None:
                engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable(model),
                                                       config=ds.config, lr_scheduler=scheduler)
                return engine
            from memstrata.runtime.swap.integration import initialize

            handed = True  # from here on, initialize closes the layer if it fails
            engine, _, _, _ = initialize(model=model, model_parameters=trainable(model), config=ds.config,
                                         lr_scheduler=scheduler, layer=layer)
            return engine
        except BaseException:
            if layer is not None and not handed:
                layer.close()
            raise

    def _loss_chunk_tokens(self) -> int:
        """spec.training.lossChunkTokens, unless the model's own loss is more than the LM head's cross-entropy:
        then the default quietly computes the logits whole (with a warning), and a value the job set is refused."""
        t = self.spec.training
        if not t.loss_chunk_tokens or self.hf_config is None:
            return t.loss_chunk_tokens
        from memstrata.runtime.train.loss import chunked_loss_refusal

        why = chunked_loss_refusal(self.hf_config)
        if why is None:
            return t.loss_chunk_tokens
        if "loss_chunk_tokens" in t.model_fields_set:
            raise RecipeError(f"spec.training.lossChunkTokens: {why}: set lossChunkTokens: 0")
        logging.getLogger(__name__).warning("memstrata: %s: the loss is computed over whole logits "
                                            "(lossChunkTokens 0)", why)
        return 0

    def _device(self) -> "torch.device":
        import torch

        return torch.device("cuda", self.ranks.local_rank) if self.on_gpu else torch.device("cpu")

    def memstrata_status(self) -> SwapStatus | None:
        """memstrata's own per-stratum counters (None on the stock engine); live while the engine is."""
        layer = getattr(self.engine, "memstrata", None)
        if layer is not None:
            self.swap_status = layer.status()
        return self.swap_status

    # --- train ---------------------------------------------------------------------------------------
    def _loss(self, inputs: "torch.Tensor", labels: "torch.Tensor") -> "torch.Tensor":
        assert self.engine is not None
        device = self.engine.device
        # Labels sit at the inputs' positions; the model shifts them (Hugging Face's convention).
        return self.engine(input_ids=inputs.to(device), labels=labels.to(device)).loss

    def evaluate(self) -> float | None:
        """Mean loss over the validation batches (None when the dataset has none), the same on every rank.

        Rank r evaluates batches r, r + W, ...; ZeRO-3 gathers every parameter in each forward, a collective, so a
        rank with one batch fewer than the others runs one more forward whose loss it does not count. The mean is
        over all batches, as one rank would have taken it."""
        import torch

        if self.engine is None or self.data is None:
            raise RuntimeError("FineTuneRecipe.evaluate() called before setup()")
        batches = self.data.validation(self.spec.training.micro_batch)
        if not batches:
            return None
        r, world = self.ranks.rank, self.ranks.world
        mine = batches[r::world]
        forwards = -(-len(batches) // world)  # what the rank with the most batches runs
        self.engine.eval()
        try:
            with torch.no_grad():
                losses = [float(self._loss(x, y).float()) for x, y in mine]
                for _ in range(forwards - len(mine)):
                    self._loss(*batches[0])  # not counted: keeps this rank in step with the others' gathers
        finally:
            self.engine.train()
        total, count = world_sum(self.ranks, self.engine.device, sum(losses), len(losses))
        return total / count

    def train(self, on_step: Callable[[StepResult], None],
              on_validation: Callable[[int, float], None] | None = None) -> TrainResult:
        """`on_step` gets every step's record (with its validation loss when one was measured);
        `on_validation` (step, loss) the validation loss measured before the first step."""
        import torch

        if self.engine is None or self.data is None:
            raise RuntimeError("FineTuneRecipe.train() called before setup()")
        t = self.spec.training
        done = self.resumed.step if self.resumed is not None else 0
        # A resumed run reads the data from where the checkpoint stood, so it sees what an uninterrupted one would;
        # each rank its own share of the global micro-batches.
        world = self.ranks.world
        batches = self.data.batches(t.micro_batch, start=self.resumed.micro_batches if self.resumed else 0,
                                    rank=self.ranks.rank, world=world)
        result = TrainResult(phases=self.phases)
        before = self.evaluate() if self.resumed is None else None
        if before is not None:
            result.validation_losses[0] = before
            if on_validation is not None:
                on_validation(0, before)
        clock = PhaseClock(synchronizer(self._device()))
        for step in range(done + 1, t.steps + 1):
            started, losses = clock.start(), []
            rate = self.engine.get_lr()[0]  # the scheduler set it after the previous update
            for _ in range(t.gradient_accumulation):
                inputs, labels = next(batches)
                clock.start()
                loss = self._loss(inputs, labels)
                self.phases.forward += clock.lap()
                self.engine.backward(loss)
                self.phases.backward += clock.lap()
                self.engine.step()  # DeepSpeed only updates at the accumulation boundary
                self.phases.step += clock.lap()
                losses.append(float(loss.detach().float()))
            # The step's loss is the mean over every rank's micro-batches (what one rank with all of them would
            # report), the same on every rank, so a non-finite loss stops all of them together.
            value = world_sum(self.ranks, self.engine.device, sum(losses) / len(losses))[0] / world
            if not torch.isfinite(torch.tensor(value)):
                raise FloatingPointError(f"loss became {value} at step {step}")
            norm = self.engine.get_global_grad_norm()
            if self.on_gpu:
                self.hbm_peak_bytes = max(self.hbm_peak_bytes, hbm_peak_bytes(self._device()))
            record = StepResult(step=step, loss=value, seconds=time.perf_counter() - started,
                                tokens=t.micro_batch * t.gradient_accumulation * t.sequence_length * world,
                                learning_rate=float(rate), grad_norm=float(norm) if norm is not None else None)
            if step == t.steps or (t.eval_interval and step % t.eval_interval == 0):
                record.validation_loss = self.evaluate()
                if record.validation_loss is not None:
                    result.validation_losses[step] = record.validation_loss
            if self.checkpointer is not None and self.checkpointer.due(step):
                try:
                    record.checkpoint = self.checkpointer.save(
                        self.engine, step=step, micro_batches=step * t.gradient_accumulation * world,
                        loss=value, validation_loss=record.validation_loss)
                except CheckpointWriteError as exc:
                    # A full or failing checkpoint volume costs this checkpoint, not the training done so far:
                    # the partial write is gone, the previous checkpoint stays the latest, training goes on.
                    record.checkpoint_error = f"{type(exc).__name__}: {exc}"
            result.steps.append(record)
            on_step(record)
        return result

    # --- save ----------------------------------------------------------------------------------------
    def save(self, step: int, validation_loss: float | None) -> OutputStatus | None:
        """Write the fine-tuned model to spec.output.path (None when the job has no output, and on every rank but
        0, which only takes part in the gathers)."""
        from memstrata.runtime.train.export import join_save, save_model

        out = self.spec.output
        if out is None:
            return None
        if self.engine is None:
            raise RuntimeError("FineTuneRecipe.save() called before setup()")
        # Parameters the last forward prefetched are still in flight; gathering one of them would assert.
        self.engine.empty_partition_cache()
        dtype = self._dtype()
        tokenizer = None if isinstance(self.tokenizer, ByteTokenizer) else self.tokenizer
        if self.adapter is not None:
            from memstrata.runtime.train import lora

            if not self.ranks.leader:
                lora.join_save(self.engine.module, self.adapter)
                return None
            self.output = lora.save_adapter(self.engine.module, Path(out.path), lora=self.adapter, tokenizer=tokenizer,
                                            shard_size=out.shard_size, step=step, dtype=dtype,
                                            validation_loss=validation_loss, job=self.job.metadata.name,
                                            job_uid=self.job_uid)
            return self.output
        if not self.ranks.leader:
            join_save(self.engine.module)
            return None
        self.output = save_model(self.engine.module, Path(out.path), tokenizer=tokenizer, shard_size=out.shard_size,
                                 step=step, dtype=dtype, validation_loss=validation_loss, job=self.job.metadata.name,
                                 job_uid=self.job_uid)
        return self.output

    # --- cleanup ----------------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Drop the engine (its aio handles hold the swap files open), the swap layer, the process group, the
        swap directory."""
        layer = getattr(self.engine, "memstrata", None)
        self.engine = None
        if self.model is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            # transformers' ZeRO-3 switch is process-global: off, so a later from_pretrained here (the
            # sample after training) loads a plain model.
            unset_hf_deepspeed_config()
            self.model = None
        try:
            if layer is not None:
                try:
                    self.swap_status = layer.status()
                finally:
                    layer.close()  # before the rmtree: it holds the namespace files open
        finally:
            try:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    dist.destroy_process_group()
            finally:
                shutil.rmtree(self.swap_dir, ignore_errors=True)
                if self.swap_owner is not None and not self.swap_dir.exists():
                    self.swap_owner.release()
