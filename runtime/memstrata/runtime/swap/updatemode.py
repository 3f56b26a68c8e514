"""Which update runs beside the training (memstrata.runtime.swap.overlap, memstrata.runtime.swap.delayed), or none:
the one decision, with its refusals in words for the layer's status."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memstrata.runtime.swap.protocols import ZeroOptimizer

if TYPE_CHECKING:
    from memstrata.runtime.swap.layer import SwapLayer

__all__ = ["install_update_beside"]


def install_update_beside(opt: ZeroOptimizer, layer: SwapLayer) -> Any:
    """The overlapped update's loop hooks (under the order hook, so they see real sub-group ids), or None where
    it is off or refused (the reason kept for the status)."""
    if layer.settings.delayed_update:
        return _delayed(opt, layer)
    wanted = layer.settings.overlap_update
    if wanted is False:
        layer.overlap_refused = "overlap_update is off"
        return None
    if wanted is None and str(layer.device).startswith("cpu"):
        layer.overlap_refused = ("the forward runs on the CPU, whose cores the update would take (overlap_update: "
                                 "true runs it beside anyway)")
        return None
    from memstrata.runtime.swap.overlap import OverlappedUpdate, refusal

    reason = refusal(opt)
    if reason is not None:
        layer.overlap_refused = reason
        return None
    layer.overlap = OverlappedUpdate(opt)
    layer.overlap.wrap_loop()
    return layer.overlap


def _delayed(opt: ZeroOptimizer, layer: SwapLayer) -> Any:
    """The delayed update the job asked for by name (on any device), or None where refused: then every update
    runs in place, exact, and the status says why."""
    from memstrata.runtime.swap.delayed import DelayedUpdate, delayed_refusal, read_until_release
    from memstrata.runtime.swap.overlap import refusal
    from memstrata.runtime.swap.resident import resident_ids

    reason = ("the gradients are also copied at the boundary (dram_gradients off)" if layer.dram_gradients is None
              else refusal(opt) or delayed_refusal(opt))
    if reason is not None:
        layer.overlap_refused = f"delayed update refused: {reason}"
        return None
    sliced = layer.sliced.ids if layer.sliced is not None else ()
    layer.overlap = DelayedUpdate(opt, sliced=sliced, late=read_until_release(opt, sliced, resident_ids(opt)))
    layer.overlap.wrap_loop()
    return layer.overlap
