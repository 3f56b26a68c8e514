"""Activation checkpoints leave the compute into the pool the plan placed, and training is unchanged by it.

On this CPU machine the "device" is the host too, so what is checked is what the plan depends on: every
checkpoint goes through the pool (its bytes are the planner's `checkpoints` bytes exactly), its pages are
where the placement rule puts them (mbind on this host's NUMA layout; the QEMU guest checks a CXL node in
e2e/node/test_native_guest.py), and loss and gradients are bitwise those of Hugging Face's checkpointing.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from memstrata.api.hfconfig import architecture_from_config
from memstrata.plan.accounting import JobShape, category_bytes
from memstrata.runtime.strata.affinity import TensorKind, place
from memstrata.runtime.strata.numa import cpu_nodes
from memstrata.runtime.strata.pinned import LockedPool
from memstrata.runtime.swap.activations import ActivationOffload
from memstrata.runtime.swap.layer import SwapLayer, SwapSettings

LAYERS, SEQ, BATCH = 4, 256, 2


def _model(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, use_cache=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def _planned_checkpoint_bytes(model: torch.nn.Module) -> int:
    arch = architecture_from_config(model.config.to_dict(), "test")
    job = JobShape(model=arch, sequence_length=SEQ, micro_batch=BATCH, precision="bf16", gpus=0, engine="memstrata")
    return category_bytes(job)["checkpoints"]


def _pool() -> LockedPool:
    # Every memory node of this host as the "CXL" nodes: the placement then really mbinds (interleave).
    return LockedPool(8 << 20, lock=False, placement=place(TensorKind.ACTIVATIONS, dram_nodes=[],
                                                           cxl_nodes=cpu_nodes()))


def _ids() -> torch.Tensor:
    return torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def test_offloaded_training_is_bitwise_hugging_faces_and_the_pool_holds_the_planned_bytes() -> None:
    ids = _ids()
    stock = _model()
    want = stock(input_ids=ids, labels=ids).loss
    want.backward()

    model = _model()
    offload = ActivationOffload(_pool())
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=offload.checkpoint)
    loss = model(input_ids=ids, labels=ids).loss
    planned = _planned_checkpoint_bytes(model)
    assert planned == LAYERS * SEQ * BATCH * 128 * 2
    # Between forward and backward the pool holds exactly what the plan counts: one hidden state per layer.
    assert offload.stats.live_bytes == offload.pool.in_use == planned
    assert offload.stats.tensors == LAYERS
    nodes = set(cpu_nodes())
    for saved in offload._saved.values():
        assert set(offload.pool.node_of_pages(saved.host)) <= nodes
    loss.backward()
    assert torch.equal(loss, want)
    for (name, p), q in zip(model.named_parameters(), stock.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert offload.stats.live_bytes == offload.pool.in_use == 0  # every checkpoint came back and was freed
    assert offload.stats.returned_bytes == offload.stats.offloaded_bytes == planned
    assert offload.stats.live_peak_bytes == planned


def test_checkpoints_a_backward_never_consumed_are_dropped() -> None:
    model = _model()
    offload = ActivationOffload(_pool())
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=offload.checkpoint)
    model(input_ids=_ids(), labels=_ids())  # a failed step: no backward
    assert offload.pool.in_use > 0
    assert offload.drop() == LAYERS
    assert offload.pool.in_use == offload.stats.live_bytes == 0


def test_no_grad_forward_offloads_nothing() -> None:
    """Evaluation runs under no_grad: no checkpoint is taken, so nothing may be copied."""
    model = _model()
    offload = ActivationOffload(_pool())
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=offload.checkpoint)
    with torch.no_grad():
        model(input_ids=_ids(), labels=_ids())
    assert offload.stats.tensors == 0 and offload.pool.in_use == 0


def test_the_swap_layer_reports_where_the_checkpoints_were(tmp_path) -> None:
    # This host's own layout (no CXL): the checkpoints are on DRAM, and with one memory node nothing is bound.
    settings = SwapSettings(no_nvme=True, lock_memory=False)
    layer = SwapLayer.open(settings, rank=0, local_rank=0, local_world=1, fallback_dir=tmp_path, needed_bytes=0)
    try:
        assert layer.status().activations is None  # nothing offloaded yet: no entry, not zeros
        model = _model()
        model._set_gradient_checkpointing(enable=True,
                                          gradient_checkpointing_func=layer.activation_offload(
                                              torch.device("cpu")).checkpoint)
        model(input_ids=_ids(), labels=_ids()).loss.backward()
        status = layer.status().activations
        assert status is not None
        assert status.stratum == "dram"
        assert status.numa_nodes == ([] if len(cpu_nodes()) == 1 else sorted(cpu_nodes()))
        assert status.live_peak_bytes == _planned_checkpoint_bytes(model)
        assert status.tensors == LAYERS and status.offloaded_bytes == status.live_peak_bytes
        assert layer.status().wire()["activations"]["livePeakBytes"] == status.live_peak_bytes
    finally:
        layer.close()


@pytest.mark.parametrize("on_cxl,nodes", [(True, (1,)), (False, (0,))])
def test_the_pool_is_on_cxl_or_bound_to_dram_as_the_plan_said(tmp_path, on_cxl: bool, nodes: tuple) -> None:
    settings = SwapSettings(no_nvme=True, lock_memory=False, dram_nodes=[0], cxl_nodes=[1],
                            activations_on_cxl=on_cxl)
    layer = SwapLayer.open(settings, rank=0, local_rank=0, local_world=1, fallback_dir=tmp_path, needed_bytes=0)
    try:
        placement = layer.activation_offload(torch.device("cpu")).pool.placement
        assert placement is not None and placement.nodes == nodes
    finally:
        layer.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: copies on a side stream, prefetch")
def test_on_a_gpu_checkpoints_leave_the_device_and_come_back_ahead_of_use() -> None:
    device = torch.device("cuda")
    ids = _ids().to(device)
    stock = _model().to(device)
    base = torch.cuda.memory_allocated()
    want = stock(input_ids=ids, labels=ids).loss
    stock_held = torch.cuda.memory_allocated() - base  # what stock keeps on the GPU from forward to backward
    want.backward()
    del base

    model = _model().to(device)
    pool = LockedPool(8 << 20, lock=False, cuda_register=True)
    offload = ActivationOffload(pool)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=offload.checkpoint)
    base = torch.cuda.memory_allocated()
    loss = model(input_ids=ids, labels=ids).loss
    torch.cuda.synchronize()
    planned = LAYERS * SEQ * BATCH * 128 * 2
    assert pool.in_use == planned
    # The checkpoints are off the GPU: it holds at least the planned bytes less than stock between the passes.
    assert torch.cuda.memory_allocated() - base <= stock_held - planned
    loss.backward()
    torch.cuda.synchronize()
    torch.testing.assert_close(loss, want)  # CUDA's sdpa backward need not be bitwise deterministic
    assert offload.stats.prefetched == LAYERS - 1  # all but the first one backward asks for
    for (name, p), q in zip(model.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    offload.drop()
    assert pool.in_use == 0

    # A backward that fails halfway (after a prefetch) leaves nothing held and nothing freed twice.
    loss = model(input_ids=ids, labels=ids).loss
    hit = []

    def fail(grad: torch.Tensor) -> torch.Tensor:
        hit.append(1)
        if len(hit) == 2:
            raise RuntimeError("injected")
        return grad

    for layer in model.model.layers:
        layer.mlp.down_proj.weight.register_hook(fail)
    with pytest.raises(RuntimeError, match="injected"):
        loss.backward()
    assert offload.drop() > 0
    torch.cuda.synchronize()
    assert pool.in_use == 0
    pool.close()
