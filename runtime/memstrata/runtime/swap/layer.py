"""One rank's swap layer: the NVMe stratum, the locked pool, the I/O token and what moved.

Built once per `memstrata.runtime.initialize` call from `SwapSettings`, and
made *active* while DeepSpeed constructs its swappers, so memstrata's swapper
classes (which DeepSpeed instantiates with its own fixed arguments) find it.
`status()` is the small payload the runtime reports per stratum.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from memstrata.plan.accounting import CACHED_SUBGROUPS, MIN_SWAP_BYTES
from memstrata.runtime.strata.nvme import NvmeEngine
from memstrata.runtime.strata.numa import cpu_nodes
from memstrata.runtime.strata.pinned import LockedPool, vm_locked_bytes
from memstrata.runtime.strata.affinity import TensorKind, place
from memstrata.runtime.strata.dma import DmaDevice, dma_device
from memstrata.runtime.swap.handle import ExtentSwapHandle, SwapCounters
from memstrata.runtime.swap.hostheap import release_free_heap
from memstrata.runtime.swap.pinning import Pins
from memstrata.runtime.swap.status import (ActivationStatus, DramStatus, MovedBytes, NvmeStatus, OverlapStatus,
                                           SwapStatus)
from memstrata.runtime.swap.tokens import IoTokens

__all__ = ["SwapSettings", "SwapLayer", "active", "activate", "node_ranks"]


class SwapSettings(BaseModel):
    """How memstrata's swap layer runs on one node. Every field has a safe default."""

    nvme: list[str] = Field(
        default_factory=list,
        description="NVMe-stratum namespaces (raw block devices, or regular files where none is spare) shared by "
                    "the node's ranks: rank r of a node uses every path i with i % local_world_size == r. Empty: one "
                    "file per rank next to DeepSpeed's nvme_path, sized from the model.")
    nvme_shared: bool = Field(
        True, description="Whether `nvme` is shared by the node's ranks (the device plugin's namespaces: each rank "
                          "takes its share) or is this rank's own (a local run's per-rank files: it takes them all).")
    ranks_per_node: int | None = Field(
        None, ge=1, description="The node's ranks the plan split `nvme` over (plan.ranks_per_node). None: an "
                                "unplanned layer, which takes the launcher's LOCAL_WORLD_SIZE.")
    job: str = Field("memstrata", description="Owner written into each namespace's header.")
    queue_depth: int = Field(32, ge=1, le=4096, description="io_uring entries per rank.")
    stripe_bytes: int = Field(1 << 20, ge=4096, description="Stripe unit over namespaces (multi-path).")
    io_token_limit: int = Field(1, ge=1, description="Ranks of one node doing I/O on the stratum at once.")
    io_token_scope: str = Field(
        "", pattern=r"^[A-Za-z0-9._-]{0,40}$",
        description="Who shares the I/O tokens: empty, every process of the node; else only the processes given the "
                    "same scope (one run's ranks on one node), so no rank ever waits for a token held by a rank it "
                    "is not in step with (another job's, or another node's of the same machine).")
    cache_subgroups: int = Field(
        CACHED_SUBGROUPS, ge=0, description="Streamed optimizer sub-groups (per rank) whose state stays in DRAM from one step to the "
                             "next (the reversed walk starts with them). The plan's DRAM share is kept resident "
                             "instead (`resident_state_bytes`); 1 is what a plan gives.")
    resident_state_bytes: int | None = Field(
        None, ge=0,
        description="Optimizer state (fp32 master + Adam moments, 12 B per element) per rank kept in DRAM for good: "
                    "whole sub-groups, as many as fit, are never swappable, so they own no NVMe extent and move no "
                    "byte per step; the rest streams through NVMe. A run from a plan sets it from the plan's DRAM "
                    "bytes for master + optimizer (memstrata.runtime.swap.stratamap); None: none (unplanned use).")
    resident_weight_bytes: int | None = Field(
        None, ge=0,
        description="16-bit parameter partitions per rank kept in DRAM when the weights are offloaded to NVMe: "
                    "each partition, in construction order, is kept if it fits what is left (first-fit); the rest "
                    "live on NVMe. None: "
                    "every swappable parameter goes to NVMe.")
    no_nvme: bool = Field(
        False, description="The plan puts nothing on NVMe: open no namespace at all; a swap request is then an "
                           "error naming the plan, never a silent file.")
    prefetch_subgroups: int = Field(
        1, ge=0, le=4,
        description="Optimizer sub-groups read ahead of the one being updated (the update pipelined: read of i+1, "
                    "Adam on i, write-back of i-1 overlap); 0 reads each one when it is needed.")
    slice_subgroups: bool = Field(
        True, description="Update a sub-group of one tensor larger than a slice (the embedding, an untied LM head) a "
                          "slice at a time through buffers of the slice's size (memstrata.runtime.swap.sliced), "
                          "instead of whole through buffers of its own size.")
    slice_elements: int | None = Field(
        None, ge=2048, multiple_of=2048,
        description="Elements per slice; None: ZeRO-3's sub_group_size rounded down to whole 2048 "
                    "(memstrata.plan.accounting.slice_elements), what the plan counts.")
    min_swap_bytes: int = Field(MIN_SWAP_BYTES, ge=4096, description="Smaller tensors stay in DRAM (DeepSpeed: 1 MiB).")
    param_staging_bytes: int = Field(256 << 20, ge=0,
                                     description="Locked bytes the parameter prefetcher may fill ahead of use.")
    pool_chunk_bytes: int = Field(32 << 20, ge=1 << 20, description="Growth step of the locked pool.")
    lock_memory: bool = Field(True, description="mlock the pool (pinned); off only where RLIMIT_MEMLOCK is tiny.")
    lock_required: bool = Field(
        False, description="Fail when RLIMIT_MEMLOCK refuses to lock the pool, instead of warning once and going on "
                           "unlocked: a restricted pod keeps the runtime's limit (8 MiB) and cannot raise it.")
    checksums: bool = Field(False, description="Verify every read against a hash of what was written (tests).")
    file_bytes: int = Field(0, ge=0, description="Size of the fallback file-backed namespace created here when "
                                                 "`nvme` is empty; 0: from the model. A run from a plan names its "
                                                 "namespaces in `nvme`, sized by stratamap from the plan.")
    force: bool = Field(False, description="Override only the foreign-signature check of a namespace.")
    dram_nodes: list[int] = Field(default_factory=list, description="DRAM NUMA nodes; empty: every node with CPUs.")
    cxl_nodes: list[int] = Field(default_factory=list, description="CPU-less CXL NUMA nodes (the plan's cxl_nodes).")
    activations_on_cxl: bool = Field(
        True, description="Activation checkpoints interleaved over `cxl_nodes` (when there are any); false keeps them "
                          "in DRAM, where a plan that found no room for them on CXL put them.")
    weights_on_cxl: bool = Field(
        True, description="16-bit weights kept in host memory (the partitions DeepSpeed pins) interleaved over "
                          "`cxl_nodes` (when there are any); false binds them to DRAM, where the plan put them.")
    one_pass_overflow: bool = Field(True, description="Replace ZeRO-3's fp16 inf/nan check with the one-pass one.")
    trim_after_step: bool = Field(
        True, description="After each update, give back the optimizer pool's regions beyond the one locked for the "
                          "update's buffers (sized once by memstrata.plan.buffers.update_buffer_bytes, kept for "
                          "the run): what a first step or a checkpoint needed beyond it.")
    overlap_update: bool | None = Field(
        None, description="Run each update beside the next forward, which waits per sub-group for the weights it "
                          "gathers (memstrata.runtime.swap.overlap). None: where the forward runs on an "
                          "accelerator (on the CPU the update would take the forward's cores); where refused, the "
                          "update runs in place.")
    delayed_update: bool = Field(
        False, description="spec.training.update delayed: each update runs beside the next step's forward and "
                           "backward, which is taken at the weights from before it (memstrata.runtime.swap.delayed; "
                           "on any device). Where refused, the update runs in place, exact.")
    dram_gradients: bool = Field(
        True, description="Keep gradients only in ZeRO-3's DRAM flat buffer (the training dtype) until the update "
                          "widens them, instead of also writing fp32 copies to NVMe (memstrata.runtime.swap.gradients).")


PINNED_CHUNK_BYTES = 2 << 20
_active: SwapLayer | None = None
_lock = threading.Lock()


def active() -> SwapLayer:
    if _active is None:
        raise RuntimeError("memstrata's swappers are only constructed inside memstrata.runtime.initialize")
    return _active


@contextlib.contextmanager
def activate(layer: SwapLayer) -> Iterator[SwapLayer]:
    global _active
    with _lock:
        if _active is not None:
            raise RuntimeError("memstrata.runtime.initialize is already running in this process")
        _active = layer
    try:
        yield layer
    finally:
        _active = None


def locked_pool(settings: SwapSettings, kind: TensorKind, *, dma: DmaDevice | None = None,
                chunk_bytes: int | None = None) -> LockedPool:
    """A locked pool for buffers of `kind`; it allocates nothing until asked.

    Optimizer operands are bound to DRAM; DMA-only data (parameter staging, activation checkpoints) is
    interleaved over the CXL nodes when there are any (memstrata.runtime.strata.affinity). With `dma` (a GPU
    copies its buffers) its regions are registered with that device and its frees fenced."""
    return LockedPool(chunk_bytes or settings.pool_chunk_bytes, lock=settings.lock_memory,
                      lock_fallback=not settings.lock_required,
                      placement=place(kind, dram_nodes=settings.dram_nodes or cpu_nodes(),
                                      cxl_nodes=settings.cxl_nodes),
                      dma=dma)


def node_ranks(settings: SwapSettings, env: Mapping[str, str]) -> int:
    """The ranks of this node that share its namespaces: the plan's, which the launcher must have started (a
    different count would give each rank a share the plan never counted); the launcher's where nothing was planned."""
    launched = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if settings.ranks_per_node is not None and settings.ranks_per_node != launched:
        raise ValueError(f"LOCAL_WORLD_SIZE={launched}: the launcher started {launched} ranks on this node, but the "
                         f"plan split the node's namespaces over plan.ranks_per_node={settings.ranks_per_node}")
    return settings.ranks_per_node or launched


class SwapLayer:
    """One rank's strata. Its pools, one per kind of buffer:

    - `pool`: the optimizer's operands (sub-groups' fp32 state and gradients in the update), bound to DRAM. Only
      the CPU (Adam, the NVMe engine) reads and writes them, so it is not registered with the GPU: the one GPU copy
      into it, stock's fp32 gradient swap-out (with `dram_gradients` off), must stay synchronous, as it is in stock;
    - `param_pool`: 16-bit partitions staged between NVMe and the GPU, DMA-only;
    - `pinned_weights`, `pinned_operands`: the host buffers DeepSpeed pins (memstrata.runtime.swap.pinning);
    - the activation checkpoints' pool, once asked for.
    On a GPU (`device` cuda) the DMA pools are registered with it (memstrata.runtime.strata.dma)."""

    def __init__(self, settings: SwapSettings, engine: NvmeEngine | None, *, rank: int, local_rank: int,
                 created_files: list[str], device: Any = None) -> None:
        self.settings = settings
        self.engine = engine
        self.rank, self.local_rank = rank, local_rank
        self.created_files = created_files
        self.device = device if device is not None else "cpu"
        self.dma = dma_device(self.device)
        self.pool = locked_pool(settings, TensorKind.OPTIMIZER)
        self.param_pool = locked_pool(settings, TensorKind.PARAM_STAGING, dma=self.dma)
        # What DeepSpeed pins is held for the whole run and mostly larger than a chunk (a region of its own each);
        # small chunks keep the many small partitions from locking a whole growth step each pool.
        weights = TensorKind.WEIGHTS if settings.weights_on_cxl else TensorKind.OPTIMIZER
        self.pinned_weights = locked_pool(settings, weights, dma=self.dma, chunk_bytes=PINNED_CHUNK_BYTES)
        self.pinned_operands = locked_pool(settings, TensorKind.OPTIMIZER, dma=self.dma,
                                           chunk_bytes=PINNED_CHUNK_BYTES)
        self.pins = Pins(self.pinned_weights, self.pinned_operands)
        self.activations: Any = None  # memstrata.runtime.swap.activations.ActivationOffload, once asked for
        self.counters = SwapCounters()
        self.tokens = IoTokens(f"nvme.{settings.io_token_scope}" if settings.io_token_scope else "nvme",
                               settings.io_token_limit, rank=local_rank)
        self.checksums: dict[str, str] | None = {} if settings.checksums else None
        self.handles: list[ExtentSwapHandle] = []
        self.param_bytes_in_use = 0
        self.cache_bytes = 0
        self.cache_hits = 0
        self.resident_state_bytes = 0  # set once ZeRO-3 has built its sub-groups (memstrata.runtime.swap.resident)
        self.resident_subgroups = 0
        self.resident_weight_bytes = 0  # grown by the parameter swapper as it keeps partitions in DRAM
        self.prefetch_hits = 0  # counted by the optimizer swapper's read-ahead
        self.overflow_checks = 0
        self.trimmed_bytes = 0
        self.huge_page_tensors: bool | None = None  # set by whoever opens it (integration.open_layer)
        self.subgroup_order: Any = None  # memstrata.runtime.swap.suborder.SubGroupOrder, once installed
        self.dram_gradients: Any = None  # memstrata.runtime.swap.gradients.DramGradients, once installed
        self.sliced: Any = None  # memstrata.runtime.swap.sliced.SlicedUpdate, once installed
        self.overlap: Any = None  # memstrata.runtime.swap.overlap.OverlappedUpdate, once installed
        self.overlap_refused = "not installed"
        self.io_log: list[tuple[str, float, float]] | None = None  # tests: (kind, start, end) per I/O batch

    @classmethod
    def open(cls, settings: SwapSettings, *, rank: int, local_rank: int, local_world: int,
             fallback_dir: Path | None, needed_bytes: int, device: Any = None) -> SwapLayer:
        paths = ([p for i, p in enumerate(settings.nvme) if i % local_world == local_rank] if settings.nvme_shared
                 else list(settings.nvme))
        created: list[str] = []
        if settings.no_nvme:
            if settings.nvme:
                raise ValueError(f"memstrata nvme: no_nvme is set and yet {len(settings.nvme)} namespaces are named; "
                                 "a plan that puts nothing on NVMe names none")
            return cls(settings, None, rank=rank, local_rank=local_rank, created_files=created, device=device)
        if settings.nvme and not paths:
            raise ValueError(f"memstrata nvme: {len(settings.nvme)} namespaces cannot serve {local_world} ranks "
                             f"of this node; give at least one per rank")
        if not paths:
            if fallback_dir is None:
                raise ValueError("memstrata nvme: the settings name no namespace and no directory was given for a "
                                 "file-backed one")
            path = fallback_dir / f"memstrata-nvme-rank{rank}.img"
            size = settings.file_bytes or needed_bytes
            fallback_dir.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(size)
            paths, created = [str(path)], [str(path)]
        engine = NvmeEngine.open(paths, job=settings.job, queue_depth=settings.queue_depth,
                                 stripe_bytes=settings.stripe_bytes, force=settings.force)
        return cls(settings, engine, rank=rank, local_rank=local_rank, created_files=created, device=device)

    def handle(self, kind: str) -> ExtentSwapHandle:
        pool = self.param_pool if kind == "param" else self.pool
        h = ExtentSwapHandle(self.engine, pool, self.counters, kind=kind, tokens=self.tokens,
                             checksums=self.checksums)
        if self.io_log is not None:
            log = self.io_log
            h.on_io = lambda k, t0, t1: log.append((k, t0, t1))
        self.handles.append(h)
        return h

    def activation_offload(self) -> Any:
        """The gradient-checkpointing function that keeps this rank's activation checkpoints (those on its compute
        device) in a pool of their own (memstrata.runtime.swap.activations), made once."""
        if self.activations is None:
            from memstrata.runtime.swap.activations import ActivationOffload

            # Kept off CXL by the plan, they are placed as the optimizer's operands are: bound to DRAM, so
            # first touch cannot put them on a CXL node once DRAM runs short.
            kind = TensorKind.ACTIVATIONS if self.settings.activations_on_cxl else TensorKind.OPTIMIZER
            self.activations = ActivationOffload(locked_pool(self.settings, kind, dma=self.dma), self.device)
        return self.activations

    def _activation_status(self) -> ActivationStatus | None:
        offload = self.activations
        if offload is None or not offload.stats.tensors:
            return None
        s, placement = offload.stats, offload.pool.placement
        on_cxl = bool(self.settings.cxl_nodes) and self.settings.activations_on_cxl
        return ActivationStatus(stratum="cxl" if on_cxl else "dram",
                                numa_nodes=list(placement.nodes) if placement is not None else [],
                                live_peak_bytes=s.live_peak_bytes, offloaded_bytes=s.offloaded_bytes,
                                returned_bytes=s.returned_bytes,
                                prefetched=s.prefetched, tensors=s.tensors, locked_bytes=offload.pool.locked_bytes)

    def trim(self) -> int:
        """Unmap every optimizer-pool region nothing is using (after an optimizer step); the bytes given back.

        Only the optimizer pool: its working set exists in the update alone. The parameter staging pool
        is refilled by every forward and backward, so trimming it would only add page faults."""
        released = self.pool.trim()
        self.trimmed_bytes += released
        release_free_heap()
        return released

    def _pinned_bytes(self) -> int:
        self.pins.reap()  # what DeepSpeed dropped since
        return self.pinned_weights.in_use + self.pinned_operands.in_use

    def status(self) -> SwapStatus:
        """Per-stratum bytes for the progress report and the job status; `.wire()` is its JSON."""
        dev = self.engine.stats() if self.engine is not None else []
        order = self.subgroup_order
        return SwapStatus(
            nvme=NvmeStatus(
                namespaces=[d.path for d in dev],
                bytes_written=sum(d.bytes_written for d in dev),
                bytes_read=sum(d.bytes_read for d in dev),
                bytes_live=self.counters.extent_bytes_live,
                bytes_live_peak=self.counters.extent_bytes_peak,
                extents_live=self.counters.extents_live,
                by_kind={k: MovedBytes(written=w, read=r) for k, (w, r) in self.counters.by_kind.items()},
                io_token_wait_seconds=round(self.tokens.wait_seconds, 3),
                io_token_bypasses=self.tokens.bypasses,
            ),
            dram=DramStatus(
                locked_bytes=self.pool.locked_bytes + self.param_pool.locked_bytes,
                locked_peak_in_use=self.pool.peak_in_use + self.param_pool.peak_in_use,
                pinned_bytes=self._pinned_bytes(),
                trimmed_bytes=self.trimmed_bytes,
                optimizer_cache_bytes=self.cache_bytes,
                optimizer_cache_hits=self.cache_hits,
                resident_state_bytes=self.resident_state_bytes,
                resident_subgroups=self.resident_subgroups,
                resident_weight_bytes=self.resident_weight_bytes,
                prefetch_hits=self.prefetch_hits,
                sliced_subgroups=len(self.sliced.ids) if self.sliced is not None else 0,
                slices_updated=self.sliced.slices_updated if self.sliced is not None else 0,
                sub_group_orders=order.history[-8:] if order is not None else [],
                gradients=self.dram_gradients.status() if self.dram_gradients is not None else None,
                vm_locked_bytes=vm_locked_bytes(),
                huge_page_tensors=self.huge_page_tensors,
            ),
            activations=self._activation_status(),
            update_overlap=(self.overlap.report() if self.overlap is not None
                            else OverlapStatus(on=False, refused=self.overlap_refused)),
        )

    def close(self) -> None:
        """Everything the layer holds, each step in turn whatever the others raise (after a failed step, a CUDA
        error among them): the activation checkpoints, the namespaces (their I/O drained), the pools (on a GPU
        after their last copies, unregistered), the I/O token, the files it created."""
        with contextlib.ExitStack() as stack:  # callbacks run last pushed first; every one runs
            for path in self.created_files:
                stack.callback(_unlink, path)
            stack.callback(self.tokens.close)
            for pool in (self.pool, self.pinned_operands, self.pinned_weights, self.param_pool):
                stack.callback(pool.close)
            if self.engine is not None:
                stack.callback(self.engine.close)
            if self.activations is not None:
                stack.callback(self.activations.pool.close)
                stack.callback(self.activations.drop)
            if self.overlap is not None:  # first: an update still running uses the pools and the engine
                stack.callback(self.overlap.join_quietly)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
