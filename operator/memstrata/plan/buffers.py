"""The page-locked host buffers a job's plan reserves per rank: weights staged from NVMe, and the optimizer update's
operands, sized by the sub-groups it streams (memstrata) or by stock DeepSpeed's pools. Pure arithmetic, no I/O;
the runtime applies the same rule to its real sub-groups (memstrata.runtime.swap.integration).
"""
from __future__ import annotations

from collections.abc import Sequence

from memstrata.api.architecture import ModelArchitecture
from memstrata.plan.accounting import (CACHED_SUBGROUPS, STATE_BYTES_PER_ELEMENT, JobShape, choose_resident,
                                       group_tensors, pages, rank_partitions, slice_elements, subgroup_unit,
                                       trained_parameters)
from memstrata.plan.stock import pinned_pool_bytes

__all__ = ["param_staging_bytes", "pinned_buffers", "streamed_subgroup_bytes", "subgroups_update_bytes",
           "update_buffer_bytes"]


def streamed_subgroup_bytes(job: JobShape, resident_state_bytes: int, read_ahead: int = 1) -> int:
    """Locked bytes one rank's optimizer update holds at once (`update_buffer_bytes`) once `choose_resident` has
    spent `resident_state_bytes`: the largest sub-group streamed whole, whether any streams a slice at a time (one
    tensor of more than `slice_elements`, memstrata.runtime.swap.sliced), and the largest gradient a resident one
    widens (a slice's for one of those); 4 B x a slice with everything resident."""
    parts = rank_partitions(job)
    unit = subgroup_unit(job)
    groups = group_tensors(parts, unit)
    sizes = [sum(parts[i] for i in g) for g in groups]
    kept, piece = choose_resident(sizes, resident_state_bytes), slice_elements(unit)
    sliced = {i for i, (n, g) in enumerate(zip(sizes, groups)) if len(g) == 1 and n > piece}
    return subgroups_update_bytes(sizes, sliced=sliced, streamed=set(range(len(sizes))) - kept, resident=kept,
                                  piece=piece, read_ahead=read_ahead)


def subgroups_update_bytes(sizes: Sequence[int], *, sliced: set[int], streamed: set[int], resident: set[int],
                           piece: int, read_ahead: int, cached: int = CACHED_SUBGROUPS) -> int:
    """`update_buffer_bytes` for sub-groups of `sizes` elements, of which `streamed` go through NVMe and `resident`
    stay in DRAM, `sliced` ones updated `piece` elements at a time: the planner's sub-groups (above) and the
    runtime's real ones (memstrata.runtime.swap.integration), by the one rule."""
    whole = max((sizes[i] for i in streamed - sliced), default=0)
    held = max((piece if i in sliced else sizes[i] for i in resident), default=0)
    return update_buffer_bytes(whole, piece if sliced & streamed else 0, read_ahead, resident=held, cached=cached)


def update_buffer_bytes(whole: int, piece: int, read_ahead: int, *, resident: int = 0,
                        cached: int = CACHED_SUBGROUPS) -> int:
    """Locked bytes of the optimizer update at its peak, per rank, page-rounded, for sub-groups of at most `whole`
    elements streamed whole, slices of `piece` elements of larger ones (where `piece` > 0) and resident sub-groups
    whose gradient is widened `resident` elements at a time; `cached` streamed sub-groups stay in DRAM from one
    walk to the next (memstrata.runtime.swap.suborder) and are held while the others are updated:
    - whole: 2 + read_ahead sub-groups' state (12 B/element: the one updated, the one written back, those read
      ahead) and the updated one's fp32 gradient (4 B); a cached one is one of these;
    - sliced: 2 + read_ahead slices' state and the gradients of the updated and the written-back slice (the
      latter's bytes carry the 16-bit cast to NVMe), 12(2 + r) + 8 B per slice element, beside the cached ones;
    - the last slice updated and written while the next sub-group is read ahead or kept: 32 B x piece + 12 B x
      whole x max(r, cached);
    - a resident sub-group's gradient (4 B x `resident`) beside the cached ones.
    gpt-125m, nothing resident, r = 1: whole 8,659,968 (a layer and the next one's first tensor), piece 7,086,080:
    max(40 x 8,659,968, 44 x 7,086,080 + 12 x 8,659,968, 32 x 7,086,080 + 12 x 8,659,968) = 415,707,136 B."""
    r, keep, state = read_ahead, cached * STATE_BYTES_PER_ELEMENT * whole, STATE_BYTES_PER_ELEMENT
    peak = max((2 + r) * state * whole + 4 * whole,
               (2 + r) * state * piece + 8 * piece + keep if piece else 0,
               2 * (state + 4) * piece + max(r, cached) * state * whole if piece else 0,
               4 * resident + keep if resident else 0)
    return pages(peak)


def param_staging_bytes(m: ModelArchitecture, w: int) -> int:
    """Locked bytes per rank for weights streamed from NVMe: two layers in flight and the largest tensor gathered
    once; the parameter swapper prefetches within it (SwapSettings.param_staging_bytes)."""
    return pages(2 * m.layer_params() * w) + pages(m.largest_tensor() * w)


def pinned_buffers(job: JobShape, optimizer_on_nvme: bool, params_on_nvme: bool, read_ahead: int = 1,
                   streamed_bytes: int | None = None) -> int:
    """Page-locked host staging for all ranks on the node.

    memstrata sizes its buffers from the model's shapes (exact size, 4 KiB aligned):
    per rank, parameters need two layers plus the largest tensor in flight, and
    streamed optimizer state what its update holds at once (`streamed_bytes`, from streamed_subgroup_bytes; by
    default as if none were resident): sub-groups of at most a layer or so whole, `read_ahead` of them read ahead,
    and a larger tensor's a slice at a time (`update_buffer_bytes`), so no tensor's size sets it.

    Stock DeepSpeed, run with the settings memstrata.runtime.train.dsconfig gives it, locks
    what memstrata.plan.stock.pinned_pool_bytes counts: buffer_count buffers of the
    largest tensor for parameters, four of the largest sub-group for optimizer state.
    """
    m, w = job.model, job.weight_bytes
    per_rank = 0
    if job.engine == "memstrata":
        if params_on_nvme:
            per_rank += param_staging_bytes(m, w)
        if optimizer_on_nvme:
            per_rank += streamed_bytes if streamed_bytes is not None else streamed_subgroup_bytes(job, 0, read_ahead)
        else:  # everything resident: only the gradients widened for the update (a slice at a time for a big one)
            per_rank += streamed_subgroup_bytes(job, trained_parameters(job) * STATE_BYTES_PER_ELEMENT, read_ahead)
    else:
        per_rank = pinned_pool_bytes(m, w, params_on_nvme=params_on_nvme, optimizer_on_nvme=optimizer_on_nvme)
    return per_rank * job.ranks
