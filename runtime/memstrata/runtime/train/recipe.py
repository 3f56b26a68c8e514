"""The local fine-tuning recipe: DeepSpeed ZeRO-3 on stock ZeRO-Infinity (`memory.engine: deepspeed`) or
with memstrata's swap layer in its place (`memory.engine: memstrata`).

Read it in order, torchtune style: `__init__` rejects settings that cannot run
here (before anything is written); `setup` builds the data, the swap
directory, the model and the DeepSpeed engine, in dependency order; `train`
is one linear loop; `cleanup` tears down the process group and removes the
swap directory. One process, world size 1: gloo on the CPU, NCCL on a GPU.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import warnings
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from memstrata.api.finetunejob import FineTuneJob
from memstrata.api.inventory import ENV_NVME_DEVICES
from memstrata.api.strataplan import Plan
from memstrata.runtime.train.data import Blocks, ByteTokenizer, build_dataset
from memstrata.runtime.train.dsconfig import DsConfig, build_ds_config, deepspeed_swap_refusal
from memstrata.runtime.swap.protocols import TrainingEngine
from memstrata.runtime.swap.status import SwapStatus
from memstrata.runtime.swap.stratamap import SwapStrata, create_file_namespaces, swap_settings


class RecipeError(ValueError):
    """The job cannot run locally as written; the message names the field and why."""


@dataclass
class Phases:
    """Wall-clock seconds spent in each phase of the run."""

    init: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    step: float = 0.0


@dataclass
class StepResult:
    step: int
    loss: float
    seconds: float
    tokens: int


@dataclass
class TrainResult:
    steps: list[StepResult] = field(default_factory=list)
    phases: Phases = field(default_factory=Phases)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpu_available() -> bool:
    if not Path("/proc/driver/nvidia/gpus").exists():
        return False  # importing torch.cuda costs time and is pointless here
    import torch

    return torch.cuda.is_available()


class FineTuneRecipe:
    def __init__(self, job: FineTuneJob, plan: Plan, nvme_path: Path) -> None:
        spec = self.spec = job.spec
        self.job, self.plan = job, plan
        self.arch = spec.model.shape()
        self.engine_name = spec.memory.engine
        if self.engine_name not in ("deepspeed", "memstrata"):
            raise RecipeError(f"spec.memory.engine: {self.engine_name!r} is not 'deepspeed' or 'memstrata'")
        if spec.resources.gpus > 1:
            raise RecipeError(f"spec.resources.gpus: a local run is one process on one device, got {spec.resources.gpus}")
        if spec.model.path is not None:
            raise RecipeError(f"spec.model.path: {spec.model.path}: loading Hugging Face weights is not supported by "
                              "local runs yet; use spec.model.preset")
        if self.arch.vocab < ByteTokenizer.VOCAB:
            raise RecipeError(f"spec.model: vocabulary of {self.arch.vocab} tokens is smaller than the byte "
                              f"tokenizer's {ByteTokenizer.VOCAB}")
        self.on_gpu = spec.resources.gpus == 1 and gpu_available()
        # One directory per run under the scratch path, so parallel runs never share swap files.
        self.swap_dir = nvme_path / f"memstrata-run-{job.metadata.name}-{os.getpid()}-{int(time.time())}"
        # With memstrata, DeepSpeed's own swap folder must stay empty (no silent fallback to the stock
        # path), so it is a subfolder of its own, apart from memstrata's file-backed namespaces.
        self.ds_swap_dir = self.swap_dir / "deepspeed" if self.engine_name == "memstrata" else self.swap_dir
        # Namespaces a device plugin granted are the NVMe stratum; stock DeepSpeed cannot write them and
        # would silently swap to the scratch directory instead. (`memstrata pod` also refuses its root filesystem.)
        granted = [p.strip() for p in os.environ.get(ENV_NVME_DEVICES, "").split(",") if p.strip()]
        refusal = deepspeed_swap_refusal(plan, self.engine_name, granted=granted, swap_dir=self.ds_swap_dir,
                                         swap_dir_on_root=False)
        if refusal is not None:
            raise RecipeError(refusal)
        self.strata: SwapStrata | None = None
        self.swap_status: SwapStatus | None = None  # memstrata's per-stratum counters, kept past cleanup
        self.data: Blocks | None = None
        self.ds: DsConfig | None = None
        self.engine: TrainingEngine | None = None
        self.phases = Phases()

    # --- setup ------------------------------------------------------------------------------------
    def load_data(self) -> None:
        """Read and validate the dataset; a bad file fails here, before anything is written."""
        if self.data is None:
            self.data = self._setup_data()

    def setup(self) -> None:
        t0 = time.perf_counter()
        self.load_data()
        self.ds = build_ds_config(self.plan, self.arch, self.spec.training, self.ds_swap_dir, self.on_gpu)
        if self.engine_name == "memstrata":
            try:
                # The plan's bytes size the DRAM cache and the namespaces; one process is one rank.
                self.strata = swap_settings(self.plan, self.arch, job=self.job.metadata.name, run_dir=self.swap_dir,
                                            env=os.environ, ranks=1)
            except ValueError as exc:
                raise RecipeError(str(exc)) from None
        self.swap_dir.mkdir(parents=True, exist_ok=False)
        self.ds_swap_dir.mkdir(exist_ok=True)
        if self.strata is not None:
            create_file_namespaces(self.strata)
        self._setup_distributed()
        self.engine = self._setup_engine(self.ds)
        self.phases.init = time.perf_counter() - t0

    def _setup_data(self) -> Blocks:
        d, t = self.spec.dataset, self.spec.training
        return build_dataset(d.synthetic, d.path, d.text_field, t.sequence_length, t.seed)

    def _setup_distributed(self) -> None:
        """Single-process torch.distributed, the way a launcher would have set it up."""
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
            os.environ.setdefault(key, value)
        # DeepSpeed picks its accelerator at import time; on a CPU node it must be told.
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if self.on_gpu else "cpu")
        import deepspeed

        for name in ("DeepSpeed", "deepspeed"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # torch 2.13 warns on every step that ZeRO-3 calls the old collective names; once is noise enough.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
        deepspeed.init_distributed(dist_backend="nccl" if self.on_gpu else "gloo", verbose=False)

    def _setup_engine(self, ds: DsConfig) -> TrainingEngine:
        import deepspeed
        import torch

        from memstrata.runtime.train.model import build_model

        torch.manual_seed(self.spec.training.seed)
        model = build_model(self.arch, self.spec.training.seed)
        if self.strata is None:
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds.config)
            return engine
        from memstrata.runtime.swap.integration import initialize

        engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=ds.config,
                                     swap=self.strata.settings)
        return engine

    def memstrata_status(self) -> SwapStatus | None:
        """memstrata's own per-stratum counters (None on the stock engine); live while the engine is."""
        layer = getattr(self.engine, "memstrata", None)
        if layer is not None:
            self.swap_status = layer.status()
        return self.swap_status

    # --- train ------------------------------------------------------------------------------------
    def train(self, on_step: Callable[[StepResult], None]) -> TrainResult:
        import torch

        if self.engine is None or self.data is None:
            raise RuntimeError("FineTuneRecipe.train() called before setup()")
        t = self.spec.training
        device = self.engine.device
        batches = self.data.batches(t.micro_batch)
        result = TrainResult(phases=self.phases)
        for step in range(1, t.steps + 1):
            started, losses = time.perf_counter(), []
            for _ in range(t.gradient_accumulation):
                inputs, labels = (x.to(device) for x in next(batches))
                t0 = time.perf_counter()
                loss = self.engine(inputs, labels)
                t1 = time.perf_counter()
                self.engine.backward(loss)
                t2 = time.perf_counter()
                self.engine.step()  # DeepSpeed only updates at the accumulation boundary
                t3 = time.perf_counter()
                self.phases.forward += t1 - t0
                self.phases.backward += t2 - t1
                self.phases.step += t3 - t2
                losses.append(float(loss.detach().float()))
            value = sum(losses) / len(losses)
            if not torch.isfinite(torch.tensor(value)):
                raise FloatingPointError(f"loss became {value} at step {step}")
            record = StepResult(step=step, loss=value, seconds=time.perf_counter() - started,
                                tokens=t.micro_batch * t.gradient_accumulation * t.sequence_length)
            result.steps.append(record)
            on_step(record)
        return result

    # --- cleanup ----------------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Drop the engine (its aio handles hold the swap files open), the swap layer, the process group, the
        swap directory."""
        layer = getattr(self.engine, "memstrata", None)
        self.engine = None
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
