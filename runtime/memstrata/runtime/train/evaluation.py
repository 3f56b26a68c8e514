"""The validation loss of a training engine, the same on every rank, and the sample answer beside it."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memstrata.runtime.train.launch import Ranks, world_sum

if TYPE_CHECKING:
    import torch

    from memstrata.runtime.train.data.packing import Batch

__all__ = ["validation_loss"]


def validation_loss(engine: Any, batches: list["Batch"], ranks: Ranks, loss: Callable[["Batch"], "torch.Tensor"],
                    sample: Callable[[], str | None]) -> tuple[float | None, str | None]:
    """Mean loss over `batches` (None when there are none) and `sample()`'s answer, with the engine in eval mode.

    Rank r evaluates batches r, r + W, ...; ZeRO-3 gathers every parameter in each forward, a collective, so a rank
    with one batch fewer than the others runs one more forward whose loss it does not count. The mean is over all
    batches, as one rank would have taken it."""
    import torch

    if not batches:
        return None, None
    r, world = ranks.rank, ranks.world
    mine = batches[r::world]
    forwards = -(-len(batches) // world)  # what the rank with the most batches runs
    engine.eval()
    try:
        with torch.no_grad():
            losses = [float(loss(batch).float()) for batch in mine]
            for _ in range(forwards - len(mine)):
                loss(batches[0])  # not counted: keeps this rank in step with the others' gathers
            answer = sample()
    finally:
        engine.train()
    total, count = world_sum(ranks, engine.device, sum(losses), len(losses))
    return total / count, answer
