"""The swap layer's paths that behave differently on a GPU, reached on this CPU machine: the accelerator's device
name and backend stubbed, registrations counted by a stand-in DMA device. What only a GPU can show (copies on side
streams, NCCL itself) is in the GPU tests and in benchmarks/gpu/check.py.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from memstrata.runtime.strata.affinity import TensorKind
from memstrata.runtime.swap.layer import SwapLayer, SwapSettings

pytestmark = pytest.mark.usefixtures("deepspeed_ready")


class _Reduced(Exception):
    pass


def test_the_fp16_overflow_flag_is_reduced_on_the_accelerators_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan reads the gradients in host memory, but NCCL reduces only device tensors: a flag made beside the
    gradients (on the CPU) failed every fp16 run on a GPU at its first overflow check."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    from memstrata.runtime.swap.integration import _one_pass_has_overflow

    monkeypatch.setattr(get_accelerator(), "current_device_name", lambda: "meta")  # a device that is not the host
    seen: list[torch.device] = []

    def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
        seen.append(tensor.device)
        raise _Reduced  # a meta flag has no value to read back; where it was reduced is the point

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    layer = SimpleNamespace(overflow_checks=0)
    grads = torch.tensor([1.0, float("inf"), 2.0], dtype=torch.float16)
    optimizer = SimpleNamespace(grad_partitions_flat_buffer=grads, dp_process_group=None,
                                _model_parallel_all_reduce=lambda tensor, op: None)
    with pytest.raises(_Reduced):
        _one_pass_has_overflow(layer)(optimizer)  # type: ignore[arg-type]
    assert seen == [torch.device("meta")] and layer.overflow_checks == 1


def test_a_layer_opened_without_a_process_group_uses_the_accelerators_backend(monkeypatch: pytest.MonkeyPatch,
                                                                              tmp_path: Path) -> None:
    """`memstrata.runtime.initialize` in a script that made no process group: on a GPU, ZeRO-3's collectives must run
    on NCCL, not on the gloo group the layer used to start."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    from memstrata.runtime.swap import integration, seamcheck

    seamcheck.ensure_verified()  # against the real DeepSpeed, before its entry point is stubbed
    started: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(deepspeed, "init_distributed", lambda dist_backend, verbose=True: started.append(dist_backend))
    monkeypatch.setattr(get_accelerator(), "communication_backend_name", lambda: "nccl")
    config = {"zero_optimization": {"offload_optimizer": {"nvme_path": str(tmp_path)}}}
    layer = integration.open_layer(config, SwapSettings(no_nvme=True, lock_memory=False), numel=0)
    layer.close()
    assert started == ["nccl"]


class _Registrations:
    """A DMA device standing in for a GPU: counts regions registered, fences that have always passed."""

    name = "cuda:0"

    def __init__(self) -> None:
        self.registered: list[int] = []

    def register(self, address: int, size: int) -> None:
        self.registered.append(size)

    def unregister(self, address: int) -> None:
        pass

    def current_stream(self) -> None:
        return None

    def fence(self, streams: Any = ()) -> SimpleNamespace:
        return SimpleNamespace(done=lambda: True, wait=lambda: None)


def test_on_a_gpu_the_pools_its_copies_touch_are_registered_and_the_optimizers_is_not(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Unregistered, an mlock'ed buffer is copied synchronously through the driver's staging buffer whatever
    `non_blocking` says: the staging, pinned and activation pools are the GPU's DMA targets and must be registered.
    The optimizer's operand pool is only read and written by the CPU (Adam, the NVMe engine); the one GPU copy into it
    (stock's fp32 gradient swap-out) must stay synchronous, so registering it would cost and risk without gain."""
    from memstrata.runtime.swap import layer as swaplayer

    device = _Registrations()
    made: list[Any] = []
    monkeypatch.setattr(swaplayer, "dma_device", lambda d: made.append(d) or (device if "cuda" in str(d) else None))
    settings = SwapSettings(no_nvme=True, lock_memory=False, pool_chunk_bytes=1 << 20)
    layer = SwapLayer.open(settings, rank=0, local_rank=0, local_world=1, fallback_dir=tmp_path, needed_bytes=0,
                           device="cuda:0")
    try:
        assert made == ["cuda:0"]
        for pool in (layer.param_pool, layer.pinned_weights, layer.pinned_operands, layer.pool):
            pool.free(pool.tensor(1024, torch.bfloat16))
        assert len(device.registered) == 3  # one region each for staging, pinned weights, pinned operands
        monkeypatch.setattr(layer.activation_offload(), "device", torch.device("cpu"))  # its hooks run here
        activations = layer.activations.pool
        activations.free(activations.tensor(1024, torch.bfloat16))
        assert len(device.registered) == 4 and layer.pool.dma is None and layer.pool.locked_bytes > 0
        assert layer.activations.pool.placement == swaplayer.locked_pool(settings, TensorKind.ACTIVATIONS).placement
    finally:
        layer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: NCCL reduces only CUDA tensors")
def test_on_a_gpu_the_fp16_overflow_flag_is_reduced_by_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed
    import torch.distributed

    from memstrata.runtime.swap.integration import _one_pass_has_overflow

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29531")):
        monkeypatch.setenv(key, value)
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    try:
        layer = SimpleNamespace(overflow_checks=0)
        for grads, overflow in (([1.0, float("inf")], True), ([1.0, 2.0], False)):
            optimizer = SimpleNamespace(grad_partitions_flat_buffer=torch.tensor(grads, dtype=torch.float16),
                                        dp_process_group=None, _model_parallel_all_reduce=lambda tensor, op: None)
            assert _one_pass_has_overflow(layer)(optimizer) is overflow  # type: ignore[arg-type]
    finally:
        torch.distributed.destroy_process_group()


def test_a_planned_layer_takes_nothing_from_deepspeeds_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The plan names the layer's namespaces (or none): nothing of memstrata's rides in DeepSpeed's config, so one
    without any nvme_path opens it; only a layer with no plan and no directory is refused, saying what to give."""
    import deepspeed
    from deepspeed import comm as dist

    from memstrata.runtime.swap import integration, seamcheck

    seamcheck.ensure_verified()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(deepspeed, "init_distributed", lambda dist_backend, verbose=True: None)
    bare: dict[str, object] = {"zero_optimization": {"stage": 3}}
    integration.open_layer(bare, SwapSettings(no_nvme=True, lock_memory=False), numel=0).close()
    layer = integration.open_layer(bare, SwapSettings(lock_memory=False), numel=1000, swap_dir=tmp_path / "own")
    layer.close()
    assert (tmp_path / "own").is_dir()
    with pytest.raises(ValueError, match="name no NVMe namespace and the DeepSpeed config has no "
                                         r"zero_optimization.offload_\*.nvme_path"):
        integration.open_layer(bare, SwapSettings(lock_memory=False), numel=1000)


def test_the_update_thread_takes_the_ranks_gpu_and_waits_for_its_copies_to_it() -> None:
    """CUDA's current device is per thread and starts at 0: the update thread (memstrata.runtime.swap.overlap) is
    put on the rank's device, and a 16-bit partition it wrote on the accelerator is waited for before the
    forward may gather it; on the CPU neither touches the accelerator."""
    from memstrata.runtime.swap.overlap import bind_thread, fence

    calls: list[Any] = []
    stream = SimpleNamespace(synchronize=lambda: calls.append("synchronize"))
    accelerator = SimpleNamespace(set_device=lambda index: calls.append(("set_device", index)),
                                  current_stream=lambda: stream)
    bind_thread(accelerator, torch.device("cuda", 3))
    assert calls == [("set_device", 3)]
    fence(accelerator, torch.empty(8, device="meta"))  # any device but the host's: the copy ran on a stream
    assert calls[-1] == "synchronize"
    calls.clear()
    bind_thread(accelerator, torch.device("cpu"))
    fence(accelerator, torch.empty(8))
    fence(accelerator, None)  # no 16-bit flat partition (weights swapped): nothing to wait for
    assert calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the update thread's device and the fence "
                                                          "on its copies are CUDA's")
@pytest.mark.parametrize("param", ["cpu", "none"])
def test_on_a_gpu_the_update_beside_the_forward_trains_bit_for_bit_as_in_place(tmp_path: Path, param: str) -> None:
    import json
    import os
    import subprocess
    import sys

    worker = Path(__file__).with_name("pipeline_worker.py")
    repo = worker.parents[2]
    runs = {}
    for overlap in (True, False):
        namespace = tmp_path / f"ns-{overlap}.img"
        namespace.write_bytes(b"")
        os.truncate(namespace, 512 << 20)
        out = tmp_path / f"{overlap}.json"
        # Beside: by default (None), which on an accelerator's forward means on; in place: turned off.
        swap = {"prefetch_subgroups": 1, "cache_subgroups": 1, "overlap_update": None if overlap else False}
        env = {**os.environ, "DS_ACCELERATOR": "cuda",
               "PYTHONPATH": os.pathsep.join([str(repo / "runtime"), str(repo / "operator")])}
        proc = subprocess.run([sys.executable, str(worker), str(namespace), str(tmp_path / f"swap-{overlap}"),
                               str(out), json.dumps(swap), "4", "sub-group=65536", f"param={param}", "warmup=5",
                               *(["hold-last=1"] if overlap else [])],
                              env=env, cwd=repo, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[overlap] = json.loads(out.read_text())
    assert runs[True]["held"] == [True] and runs[True]["overlap"]["on"], runs[True]["overlap"]
    assert runs[True]["losses"] == runs[False]["losses"]
    assert runs[True]["weights"] == runs[False]["weights"]
