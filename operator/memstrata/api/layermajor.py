"""Layer-major micro-batches: every micro-batch of a step passes a layer before any passes the next one.

With gradient accumulation a ZeRO-3 engine runs the step's micro-batches one after the other, and every one of
them gathers every weight again: with the weights on NVMe each micro-batch reads all of them (forward, and again
in backward), so a step of G micro-batches reads the model 2G times. Run layer-major (GreedySnake's schedule,
arXiv 2512.17570), a layer's weights are gathered once for all G micro-batches in forward and once in backward:
the model is read twice a step, whatever G is. The price is the activation checkpoints of all G micro-batches
at once (G x the layers' input hidden states, which memstrata's engine keeps off the compute device), and the
final norm's input for all G.

The numerics are a micro-batch loop's: each micro-batch runs every layer alone, with its own shapes, and its loss
is its own mean; only the order in which autograd sums the micro-batches' gradients of a weight differs (it sums
them in the training dtype, as DeepSpeed accumulates them by default). Random draws (dropout, NEFTune's noise)
come in another order: the same distributions, not the same numbers. This module is the one rule for where it
can run; the planner turns it on where weights live on NVMe (`spec.training.layerMajor` unset), or as the spec
says.
"""
from __future__ import annotations

from memstrata.api.base import cel

__all__ = ["LAYER_MAJOR_RULE", "layer_major_refusal"]

# `layer_major_refusal` for the API server, on the whole spec (memstrata.api.crd.spec_rules).
LAYER_MAJOR_RULE = cel(
    "!has(self.training.layerMajor) || !self.training.layerMajor || ("
    "(!has(self.memory) || !has(self.memory.engine) || self.memory.engine == 'memstrata') && "
    "has(self.training.gradientAccumulation) && self.training.gradientAccumulation > 1 && "
    "(!has(self.training.activationCheckpointing) || self.training.activationCheckpointing) && "
    "(!has(self.training.lossChunkTokens) || self.training.lossChunkTokens > 0))",
    "training.layerMajor needs memory.engine memstrata, gradientAccumulation > 1, activationCheckpointing and "
    "lossChunkTokens > 0", ".training.layerMajor")


def layer_major_refusal(*, engine: str, gradient_accumulation: int, activation_checkpointing: bool,
                        loss_chunk_tokens: int) -> str | None:
    """Why a job of this shape cannot run layer-major (None: it can)."""
    if engine != "memstrata":
        return "needs memory.engine: memstrata (stock DeepSpeed runs one micro-batch at a time)"
    if gradient_accumulation < 2:
        return ("needs training.gradientAccumulation of 2 or more (with one micro-batch a step every weight is "
                "already read once)")
    if not activation_checkpointing:
        return ("needs training.activationCheckpointing: without it every micro-batch's activations of every layer "
                "would be live at once")
    if loss_chunk_tokens == 0:
        return "needs training.lossChunkTokens above 0: each micro-batch's loss is its own mean, taken chunk by chunk"
    return None
