"""The compute device as a run sees it: a job that asks for a GPU trains on one or fails naming the field, DeepSpeed
is set up for the device the run uses whatever the environment said, and phase times are the device's."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from memstrata.runtime.train.observe.device import PhaseClock
from memstrata.runtime.train.preflight import RecipeError, accelerator_env, on_gpu_for

REPO = Path(__file__).resolve().parents[2]


def test_a_job_that_asks_for_a_gpu_never_trains_on_the_cpu_instead() -> None:
    with pytest.raises(RecipeError, match=r"spec\.resources\.gpus: the job asks for 1 GPU\(s\) and this process "
                                          r"sees none .*set gpus: 0 to train on the CPU"):
        on_gpu_for(1, visible=lambda: 0)
    assert on_gpu_for(1, visible=lambda: 1) is True
    assert on_gpu_for(0, visible=lambda: 8) is False  # gpus: 0 trains on the CPU even where GPUs are


def test_deepspeed_is_told_the_runs_device_whatever_was_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "deepspeed.accelerator.real_accelerator", raising=False)  # not yet set up
    env = {"DS_ACCELERATOR": "cpu"}  # left over in a GPU pod's environment
    assert accelerator_env(True, env) == "cuda" and env["DS_ACCELERATOR"] == "cuda"


def test_a_process_whose_deepspeed_runs_on_another_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed picks its accelerator once per process: a run for the GPU in a process set up for the CPU would
    put half of it on each. Said, naming the variable, before anything is built."""
    chosen = types.SimpleNamespace(ds_accelerator=types.SimpleNamespace(device_name=lambda: "cpu"))
    monkeypatch.setitem(sys.modules, "deepspeed.accelerator.real_accelerator", chosen)
    with pytest.raises(RecipeError, match=r"DS_ACCELERATOR: DeepSpeed was already set up in this process for 'cpu', "
                                          r"but this run trains on 'cuda'"):
        accelerator_env(True, {})
    assert accelerator_env(False, {}) == "cpu"


def test_a_cpu_run_in_an_environment_that_says_cuda_trains_on_the_cpu(tmp_path: Path) -> None:
    """`memstrata run` of a CPU job (gpus: 0) from a shell that exported DS_ACCELERATOR=cuda: kept, DeepSpeed would
    look for CUDA on a machine without it; the run trains on the CPU as the job says."""
    doc = yaml.safe_load((REPO / "examples" / "finetune-tiny.yaml").read_text())
    doc["spec"]["training"]["steps"] = 2
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "DS_ACCELERATOR": "cuda", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "memstrata.cli", "run", str(job), "--nvme-path", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2/2" in proc.stdout + proc.stderr


class _Device:
    """A device that runs what is queued only when the host waits for it, as a GPU does."""

    def __init__(self) -> None:
        self.now = 0.0
        self.queued = 0.0

    def queue(self, seconds: float) -> None:
        self.queued += seconds  # returns at once, like a kernel launch

    def synchronize(self) -> None:
        self.now += self.queued
        self.queued = 0.0


def test_each_phase_is_charged_the_device_time_it_queued() -> None:
    gpu = _Device()
    clock = PhaseClock(gpu.synchronize, clock=lambda: gpu.now)
    clock.start()
    gpu.queue(3.0)  # forward
    forward = clock.lap()
    gpu.queue(5.0)  # backward
    backward = clock.lap()
    gpu.queue(1.0)  # the update
    assert (forward, backward, clock.lap()) == (3.0, 5.0, 1.0)


def test_the_hbm_peak_counts_what_torch_reserved_and_what_lives_outside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """max_memory_allocated alone missed the allocator's cache, the CUDA context and NCCL's buffers: on an H100 the
    llama3.2-1b run allocated at most 8.4 GB of tensors while the process held 18.8 GB of the device."""
    import torch

    from memstrata.runtime.train.observe.device import hbm_peak_bytes

    GB = 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GB, 80 * GB))  # 20 GB used now
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 17 * GB)  # 3 GB of it outside torch
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 18 * GB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 9 * GB)
    assert hbm_peak_bytes("cuda:0") == 21 * GB
    assert hbm_peak_bytes("cpu") == 0
