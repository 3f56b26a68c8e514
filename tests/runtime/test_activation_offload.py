"""Activation checkpoints leave the compute into the pool the plan placed, and training is unchanged by it.

On this CPU machine the "device" is the host too, so what is checked is what the plan depends on: every
checkpoint goes through the pool (its bytes are the planner's `checkpoints` bytes exactly), its pages are
where the placement rule puts them (mbind on this host's NUMA layout; the QEMU guest checks a CXL node in
e2e/node/test_native_guest.py), and loss and gradients are bitwise those of Hugging Face's checkpointing.
"""
from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from transformers import AutoModelForCausalLM, LlamaConfig

from memstrata.api.hfconfig import architecture_from_config
from memstrata.plan.accounting import JobShape, category_bytes
from memstrata.runtime.strata.affinity import TensorKind, place
from memstrata.runtime.strata.dma import CudaDma
from memstrata.runtime.strata.numa import cpu_nodes
from memstrata.runtime.strata.pinned import LockedPool
from memstrata.runtime.swap.activations import ActivationOffload, worth_offloading
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
    out = model(input_ids=_ids(), labels=_ids())  # a failed step: no backward, the graph still held
    assert offload.pool.in_use > 0
    assert offload.drop() == LAYERS
    assert offload.pool.in_use == offload.stats.live_bytes == 0
    del out  # autograd lets go of the dropped checkpoints: nothing is freed twice
    assert offload.pool.in_use == offload.stats.live_bytes == 0
    model(input_ids=_ids(), labels=_ids())  # the graph dropped at once: its checkpoints go back by themselves
    assert offload.stats.tensors == 2 * LAYERS and offload.pool.in_use == offload.stats.live_bytes == 0


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
                                          gradient_checkpointing_func=layer.activation_offload().checkpoint)
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
        placement = layer.activation_offload().pool.placement
        assert placement is not None and placement.nodes == nodes
    finally:
        layer.close()


class _SavesWhatCheckpointsSave(torch.autograd.Function):
    """Saves what a checkpoint can hand the hooks, as torch up to 2.12 does on a GPU: its `_NoopSaveInputs` dummy (a
    zero-element float32 CPU tensor, whatever the compute device), the hidden state, and beside them integer
    positions, a transposed (dense, non-contiguous) view, a slice of a larger tensor and an expanded mask. Backward
    hands back what it got, so a test sees each tensor exactly as the hooks returned it."""

    @staticmethod
    def forward(ctx, x, *extra):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(torch.empty((0,)), x, *extra)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        _SavesWhatCheckpointsSave.unpacked = list(ctx.saved_tensors)
        return (grad,) + (None,) * (len(ctx.saved_tensors) - 2)


def _saved_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(BATCH, SEQ, 128, generator=g).to(torch.bfloat16).requires_grad_()
    positions = torch.arange(SEQ * BATCH, dtype=torch.int64).view(BATCH, SEQ)  # 4 KiB: worth a page
    transposed = torch.randn(64, 96, generator=g).t()  # dense, strides (1, 96)
    sliced = torch.randn(4, 4096, generator=g)[1]  # a view at an offset into a larger storage
    mask = torch.ones(1, 1, 1, SEQ, dtype=torch.bool).expand(BATCH, 4, SEQ, SEQ)  # stride 0: no span to copy
    return [hidden, positions, transposed, sliced, mask]


def test_every_tensor_a_checkpoint_can_save_round_trips_and_only_device_data_worth_moving_is_pooled() -> None:
    """What a GPU checkpoint saves, fed to the hooks on the CPU: the zero-element CPU dummy that made every GPU run
    fail at its first backward ('buffer was not handed out by this pool') is kept where it is; the rest come back
    equal, same dtype, shape and strides; the pool held exactly the tensors worth a page, and nothing is left."""
    offload = ActivationOffload(_pool())
    tensors = _saved_tensors()
    hidden = tensors[0]
    with saved_tensors_hooks(offload._pack, offload._unpack):
        out = _SavesWhatCheckpointsSave.apply(*tensors)
    pooled = [t for t in tensors if worth_offloading(t, torch.device("cpu"))]
    assert [t.dtype for t in pooled] == [torch.bfloat16, torch.int64, torch.float32, torch.float32]
    assert offload.pool.in_use == offload.stats.live_bytes == sum(t.numel() * t.element_size() for t in pooled)
    assert (offload.stats.tensors, offload.stats.kept) == (4, 2)  # the dummy and the expanded mask stay
    out.float().sum().backward()
    dummy, *back = _SavesWhatCheckpointsSave.unpacked
    assert dummy.numel() == 0 and dummy.device.type == "cpu" and dummy.dtype == torch.float32
    for got, want in zip(back, tensors):
        assert torch.equal(got, want) and got.dtype == want.dtype and got.stride() == want.stride()
    assert back[4].data_ptr() == tensors[4].data_ptr()  # the mask is the very tensor: no copy was made of it
    assert torch.equal(hidden.grad, torch.ones_like(hidden))
    assert offload.pool.in_use == offload.stats.live_bytes == 0
    assert offload.stats.returned_bytes == offload.stats.offloaded_bytes


def test_what_goes_to_the_pool_is_what_lies_on_the_compute_device_and_is_worth_a_copy() -> None:
    """The rule on a GPU, with meta tensors standing for device tensors: torch's dummy lies on the CPU while the
    compute is elsewhere, so it stays; so does anything on the host, below a page, or without a span of its own."""
    gpu = torch.device("meta")
    assert worth_offloading(torch.empty((BATCH, SEQ, 128), dtype=torch.bfloat16, device=gpu), gpu)
    assert not worth_offloading(torch.empty((0,)), gpu)  # the dummy
    assert not worth_offloading(torch.empty((BATCH, SEQ, 128), dtype=torch.bfloat16), gpu)  # on the host
    assert not worth_offloading(torch.empty((16,), dtype=torch.int64, device=gpu), gpu)  # 128 B
    assert not worth_offloading(torch.empty((1, SEQ), device=gpu).expand(64, SEQ), gpu)
    assert worth_offloading(torch.empty((96, 64), device=gpu).t(), gpu)


def test_prefetch_fetches_what_the_layer_before_offloaded_when_backward_unpacks_a_layer() -> None:
    """Backward asks for checkpoints last layer first; unpacking a layer's starts the copy back of every tensor the
    layer call before it offloaded (a hidden state and, say, rotary tables passed positionally), whatever was packed
    in between (torch's dummies, kept where they are), and nothing of the layers before that."""
    offload = ActivationOffload(_pool())
    packed = []
    for layer in range(3):
        offload._call += 1  # what checkpoint() counts: one call per checkpointed layer
        assert offload._pack(torch.empty((0,))).numel() == 0  # a dummy, packed between two hidden states: kept
        packed.append([offload._pack(torch.full((BATCH, SEQ, 128), float(layer))),
                       offload._pack(torch.full((SEQ, 64), -float(layer)))])
    assert offload.stats.kept == 3 and offload.stats.tensors == 6
    assert torch.equal(offload._unpack(packed[2][0]), torch.full((BATCH, SEQ, 128), 2.0))
    assert all(s.back is not None for s in packed[1]) and all(s.back is None for s in packed[0])
    assert torch.equal(offload._unpack(packed[2][1]), torch.full((SEQ, 64), -2.0))
    assert torch.equal(offload._unpack(packed[1][1]), torch.full((SEQ, 64), -1.0))
    assert torch.equal(offload._unpack(packed[1][0]), torch.full((BATCH, SEQ, 128), 1.0))
    assert offload._unpack(packed[0][0]).eq(0).all() and offload._unpack(packed[0][1]).eq(0).all()
    assert offload.stats.prefetched == 4 and offload.pool.in_use == 0
    assert offload._unpack(packed[2][0]) is offload._unpack(packed[2][0])  # unpacked again: the same, no copy


@pytest.mark.gpu
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
    pool = LockedPool(8 << 20, lock=False, dma=CudaDma(device))
    offload = ActivationOffload(pool, device)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=offload.checkpoint)
    base = torch.cuda.memory_allocated()
    loss = model(input_ids=ids, labels=ids).loss
    torch.cuda.synchronize()
    planned = LAYERS * SEQ * BATCH * 128 * 2
    assert pool.in_use == planned
    # The checkpoints are off the GPU: it holds at least the planned bytes less than stock between the passes.
    assert torch.cuda.memory_allocated() - base <= stock_held - planned
    assert offload.stats.tensors == LAYERS  # the hidden states, and nothing torch saves beside them
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
