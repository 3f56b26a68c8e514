"""The local fine-tuning recipe: DeepSpeed ZeRO-3 on stock ZeRO-Infinity (`memory.engine: deepspeed`) or
with memstrata's swap layer in its place (`memory.engine: memstrata`).

Read it in order, torchtune style: `__init__` rejects settings that cannot run
here (before anything is written): the model directory, the tokenizer, the
dataset and the output path are all checked there (memstrata.runtime.train.preflight);
`setup` builds the swap directory, the model (straight into its ZeRO-3 partitions,
weights streamed in) and the DeepSpeed engine, in dependency order
(memstrata.runtime.train.building); `train` is one linear loop with
validation; `save` writes the fine-tuned model; `cleanup` tears down the
process group and removes the swap directory. Gloo on the CPU, NCCL on a GPU.

One process is one rank. Alone (world size 1) it sets up its own process group;
started by a launcher (memstrata.runtime.train.launch: torch elastic, which
sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT) it is one of `Ranks.world`: it trains on its own share of the
micro-batches (memstrata.runtime.train.data.pipeline, the module doc), on cuda:LOCAL_RANK
on a GPU node, with a swap directory and DRAM cache slice of its own, and every
number it reports (loss, tokens, validation loss) is the whole world's.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from memstrata.api.finetunejob import FineTuneJob
from memstrata.api.jobdata import DEFAULT_SHARD
from memstrata.api.jobstatus import OutputStatus
from memstrata.api.inventory import ENV_NVME_DEVICES
from memstrata.api.strataplan import Plan
from memstrata.runtime.train.checkpoints.checkpoint import CheckpointError, CheckpointWriteError, Resumed
from memstrata.runtime.train.data.packing import Batch
from memstrata.runtime.train.data.pipeline import ByteTokenizer, TrainData, build_data
from memstrata.runtime.train.best import Selection, reclaim_best_partials
from memstrata.runtime.train.evaluation import validation_loss
from memstrata.runtime.train.model.generate import engine_answer
from memstrata.runtime.train.epochs import with_epoch_steps
from memstrata.runtime.train.model.export import reclaim_partials
from memstrata.runtime.train.observe.metrics import Phases, StepResult, TrainResult
from memstrata.runtime.train.launch import world_sum
from memstrata.runtime.train.model.layermajor import LayerMajor, LayerMajorError
from memstrata.runtime.train.model.owner import Ownership, own, reclaim
from memstrata.runtime.train.observe.device import PhaseClock, hbm_peak_bytes, synchronizer
from memstrata.runtime.train.dsconfig import DsConfig, build_ds_config, deepspeed_swap_refusal
from memstrata.runtime.train.preflight import (
    RecipeError, check_adapter, checkpoints, engine_of, hf_config, loss_chunk_tokens, on_gpu_for, rank_of, read_model,
    read_output, job_tokenizer, runs_layer_major,
)
from memstrata.runtime.train.building import build_engine, setup_distributed, torch_dtype
from memstrata.runtime.swap.protocols import TrainingEngine
from memstrata.runtime.swap.hostheap import bound_host_heap
from memstrata.runtime.swap.status import SwapStatus
from memstrata.runtime.swap.stratamap import SwapStrata, create_file_namespaces, swap_settings


if TYPE_CHECKING:
    import torch

SWAP_DIR_PREFIX = "memstrata-run-"  # a run's scratch directory under the NVMe path (one per run and rank)


class FineTuneRecipe:
    def __init__(self, job: FineTuneJob, plan: Plan, nvme_path: Path, *, resume: bool = False,
                 job_uid: str = "", expected_checkpoint: int | None = None) -> None:
        """`resume`: continue from the newest intact checkpoint under spec.checkpoint.path when there is one
        (without it, existing checkpoints are refused rather than overwritten); `job_uid`: the FineTuneJob's
        uid, which a checkpoint must share; `expected_checkpoint`: the newest checkpoint step the job's status
        reported, which must still be there."""
        spec = self.spec = job.spec
        self.job, self.plan, self.job_uid = job, plan, job_uid
        self.engine_name = engine_of(spec, plan)
        self.ranks = rank_of(spec)
        self.model_dir = read_model(spec)
        # The planner's shape: a vocabulary row per added token.
        self.arch = spec.model.trained_shape(self.model_dir.architecture if self.model_dir is not None else None)
        self.hf_config = hf_config(self.model_dir)
        if self.hf_config is not None:
            self.hf_config.vocab_size = self.arch.vocab
        self.loss_chunk_tokens = loss_chunk_tokens(spec.training, self.hf_config)
        self.runs_layer_major = runs_layer_major(spec.training, plan, self.loss_chunk_tokens)
        self.layer_major: LayerMajor | None = None  # installed on the engine's model in setup
        self.adapter = check_adapter(spec, self.hf_config, self.arch, preset=self.model_dir is None)
        self.tokenizer = job_tokenizer(spec, self.model_dir, self.arch)
        self.data: TrainData | None = None
        if spec.training.epochs is not None:  # the steps they take are known once the data is read
            self.load_data()
            assert self.data is not None
            spec = self.spec = job.spec = with_epoch_steps(spec, self.data, self.ranks.world)
        self.finished = read_output(spec, job=job.metadata.name, job_uid=job_uid, resume=resume)
        self.resumed: Resumed | None = None
        self.checkpointer, self.found = checkpoints(spec, job=job.metadata.name, job_uid=job_uid, arch=self.arch,
                                                    engine=self.engine_name, resume=resume,
                                                    expected=expected_checkpoint)
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
        self.output: OutputStatus | None = None
        self.model: Any = None  # the transformers model inside the engine
        self.ds: DsConfig | None = None
        self.engine: TrainingEngine | None = None
        self.phases = Phases()
        self.result = TrainResult(phases=self.phases)  # this attempt's steps so far (train() starts it afresh)
        self.sample: str | None = None  # the answer to training.evalSamplePrompt at the latest evaluation
        self.hbm_peak_bytes = 0  # the device memory held at its peak so far (GPU runs; train.observe.device)

    # --- setup ------------------------------------------------------------------------------------
    def _reclaim(self) -> None:
        """Remove the scratch directories and partial outputs of runs that died without cleaning up (never a
        live run's: memstrata.runtime.train.model.owner)."""
        out = self.spec.output
        left = reclaim(self.swap_dir.parent, SWAP_DIR_PREFIX) + (
            reclaim_partials(Path(out.path)) + reclaim_best_partials(Path(out.path)) if out else [])
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
                                  world=self.ranks.world, layer_major=self.runs_layer_major)
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
        if self.runs_layer_major:
            try:
                self.layer_major = LayerMajor.install(self.engine, self.spec.training.gradient_accumulation)
            except LayerMajorError as exc:
                raise RecipeError(str(exc)) from None
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
        from memstrata.runtime.train.checkpoints.ckptgroup import Group

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
        setup_distributed(self.on_gpu, self.ranks.local_rank)

    def _dtype(self) -> "torch.dtype":
        return torch_dtype(self.spec.training.precision)

    def _setup_engine(self, ds: DsConfig) -> TrainingEngine:
        return build_engine(ds, self.spec.training, self.arch, dtype=self._dtype(), hf_config=self.hf_config,
                            model_dir=self.model_dir, swap=self.strata.settings if self.strata is not None else None,
                            loss_chunk_tokens=self.loss_chunk_tokens, adapter=self.adapter, built=self._built)

    def _built(self, model: Any) -> None:
        self.model = model  # the transformers model inside the engine, kept for cleanup even if initialize fails

    def device(self) -> "torch.device":
        import torch

        return torch.device("cuda", self.ranks.local_rank) if self.on_gpu else torch.device("cpu")

    def memstrata_status(self) -> SwapStatus | None:
        """memstrata's own per-stratum counters (None on the stock engine); live while the engine is."""
        layer = getattr(self.engine, "memstrata", None)
        if layer is not None:
            self.swap_status = layer.status()
        return self.swap_status

    # --- train ---------------------------------------------------------------------------------------
    def _loss(self, batch: "Batch") -> "torch.Tensor":
        assert self.engine is not None
        # Labels sit at the inputs' positions; the model shifts them (Hugging Face's convention). The position ids
        # keep packed examples apart (memstrata.runtime.train.data.packing); without the cache, whose presence
        # turns Transformers' packed-sequence masking off, which training never reads anyway.
        return self.engine(**batch.model_inputs(self.engine.device), use_cache=False).loss

    def evaluate(self) -> float | None:
        """Mean loss over the validation batches (None when the dataset has none), the same on every rank; the
        answer to training.evalSamplePrompt goes to `self.sample`."""
        if self.engine is None or self.data is None:
            raise RuntimeError("FineTuneRecipe.evaluate() called before setup()")
        t, engine = self.spec.training, self.engine

        def sample() -> str | None:
            return (engine_answer(engine.module, self.tokenizer, t.eval_sample_prompt, t.eval_sample_tokens,
                                  self.device()) if t.eval_sample_prompt else None)

        batches = self.data.validation(t.micro_batch)
        loss, answer = validation_loss(engine, batches, self.ranks, self._loss, sample)
        if batches:
            self.sample = answer
        return loss

    def _micro_steps(self, batches: Iterator["Batch"]) -> list["Batch"]:
        """The forwards of one step: its micro-batches, or layer-major all of them stacked as one."""
        taken = [next(batches) for _ in range(self.spec.training.gradient_accumulation)]
        return [Batch.stacked(taken)] if self.layer_major is not None else taken

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
        result = self.result = TrainResult(phases=self.phases)
        out = self.spec.output
        self.selection = Selection(t, Path(out.path) if out else None, leader=self.ranks.leader, resumed_step=done,
                                   resumed=self.resumed.manifest.selection if self.resumed is not None else None)
        before = self.evaluate() if self.resumed is None else None
        if before is not None:
            result.validation_losses[0] = before
            if on_validation is not None:
                on_validation(0, before)
        clock = PhaseClock(synchronizer(self.device()))
        for step in range(done + 1, t.steps + 1):
            started = clock.start()
            rate = self.engine.get_lr()[0]  # the scheduler set it after the previous update
            losses = [self._micro_step(batch, clock) for batch in self._micro_steps(batches)]
            # The step's loss is the mean over every rank's micro-batches (what one rank with all of them would
            # report), the same on every rank, so a non-finite loss stops all of them together.
            value = world_sum(self.ranks, self.engine.device, sum(losses) / len(losses))[0] / world
            if not torch.isfinite(torch.tensor(value)):
                raise FloatingPointError(f"loss became {value} at step {step}")
            norm = self.engine.get_global_grad_norm()
            if self.on_gpu:
                self.hbm_peak_bytes = max(self.hbm_peak_bytes, hbm_peak_bytes(self.device()))
            record = StepResult(step=step, loss=value, seconds=time.perf_counter() - started,
                                tokens=t.micro_batch * t.gradient_accumulation * t.sequence_length * world,
                                learning_rate=float(rate), grad_norm=float(norm) if norm is not None else None)
            if step == t.steps or (t.eval_interval and step % t.eval_interval == 0):
                self._evaluate_after(record, result)
            self._checkpoint(record, micro_batches=step * t.gradient_accumulation * world)
            result.steps.append(record)
            on_step(record)
            if self.selection.stop_reason is not None:
                result.stopped_early = f"stopped early after step {step}: {self.selection.stop_reason}"
                break
        return result

    def _micro_step(self, batch: "Batch", clock: PhaseClock) -> float:
        """Forward, backward and DeepSpeed's step (which updates only at the accumulation boundary); the loss."""
        assert self.engine is not None
        clock.start()
        with self.layer_major.step() if self.layer_major is not None else contextlib.nullcontext():
            loss = self._loss(batch)
        self.phases.forward += clock.lap()
        if self.layer_major is not None:
            self.layer_major.backward(self.engine, loss)
        else:
            self.engine.backward(loss)
        self.phases.backward += clock.lap()
        self.engine.step()
        self.phases.step += clock.lap()
        return float(loss.detach().float())

    def _evaluate_after(self, record: StepResult, result: TrainResult) -> None:
        """The validation loss after `record`'s step, which may make its model the best kept so far."""
        record.validation_loss = self.evaluate()
        record.sample = self.sample
        if record.validation_loss is not None:
            result.validation_losses[record.step] = record.validation_loss
            self.selection.observe(record.step, record.validation_loss,
                                   lambda path, step, loss: self.save(step, loss, path=path, best=True))

    def _checkpoint(self, record: StepResult, micro_batches: int) -> None:
        """Save a checkpoint after `record`'s step when one is due."""
        if self.checkpointer is None or not self.checkpointer.due(record.step):
            return
        try:
            record.checkpoint = self.checkpointer.save(self.engine, step=record.step, micro_batches=micro_batches,
                                                       loss=record.loss, validation_loss=record.validation_loss,
                                                       selection=self.selection.state())
        except CheckpointWriteError as exc:
            # A full or failing checkpoint volume costs this checkpoint, not the training done so far:
            # the partial write is gone, the previous checkpoint stays the latest, training goes on.
            record.checkpoint_error = f"{type(exc).__name__}: {exc}"
            return
        if self.checkpointer.spec.export_model:  # a model transformers loads while the run goes on (a failure
            # here is the run's: the other ranks are in the export's gathers, as for the final model)
            self.save(record.step, record.validation_loss, path=Path(record.checkpoint.path) / "model")

    # --- save ----------------------------------------------------------------------------------------
    def save(self, step: int, validation_loss: float | None, path: Path | None = None,
             best: bool = False) -> OutputStatus | None:
        """Write the fine-tuned model to spec.output.path, or `path` (None when the job has no output, and on every
        rank but 0, which only takes part in the gathers)."""
        from memstrata.runtime.train.model.card import model_card
        from memstrata.runtime.train.model.writing import write_model

        out = self.spec.output
        if out is None and path is None:
            return None
        if self.engine is None:
            raise RuntimeError("FineTuneRecipe.save() called before setup()")
        # Parameters the last forward prefetched are still in flight; gathering one of them would assert.
        self.engine.empty_partition_cache()
        card = model_card(self.spec, job=self.job.metadata.name, step=step, losses=self.result.losses(),
                          validation={s: v for s, v in self.result.validation_losses.items() if s <= step},
                          formats=[d.format for d in getattr(self.data, "sets", [])], best=best)
        written = write_model(self.engine.module, path or Path(out.path if out else ""), adapter=self.adapter, card=card,
                              leader=self.ranks.leader, shard_size=out.shard_size if out else DEFAULT_SHARD,
                              tokenizer=None if isinstance(self.tokenizer, ByteTokenizer) else self.tokenizer,
                              step=step, dtype=self._dtype(), validation_loss=validation_loss,
                              job=self.job.metadata.name, job_uid=self.job_uid, arch=self.arch)
        if path is None:
            self.output = written
        return written

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
