"""Layer-major micro-batches (memstrata.api.layermajor): each layer's weights gathered once per step, not per
micro-batch.

The trainer hands the model a step's G micro-batches as one batch, their rows stacked. The embedding, the final
norm and the head do per-token work, so they run once over all of them with the same values; each decoder layer's
`forward` is replaced on the instance by one that runs the layer once per micro-batch, through the layer's own
forward (gradient checkpointing included, so backward recomputes one micro-batch of one layer at a time), and
stacks the outputs. The head takes each micro-batch's loss alone and averages them (memstrata.runtime.train.model.
loss), which is what DeepSpeed's accumulation of loss / G computes.

ZeRO-3 gathers a module's parameters when the module is called and releases them when it returns, so a layer
called G times would still be read G times. `Holds` keeps one layer's parameters gathered from its first
micro-batch to its last: it marks each as in use by a module that does not exist (ZeRO-3 releases a parameter only
while no module uses it: `ds_active_sub_modules`), then clears the marks and releases them through ZeRO-3's own
coordinator. In forward that brackets the G calls. In backward an autograd node on the layer's output sets the
marks (its gradient arrives before any micro-batch's backward of the layer) and one on its input clears them (its
gradient is whole only after all G); where the input needs no gradient (the first layer under a frozen
embedding) the trainer's `settle()` after backward does, before the update writes new weights (ZeRO-3's step
would release it too: it releases every parameter and clears every mark before it updates).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Holds", "LayerMajor", "LayerMajorError", "decoder_layers"]

# Marks a parameter as in use in ZeRO-3's `ds_active_sub_modules` (a set of module ids, counted up from 0).
HOLD_MARK = -7_301
# Keyword arguments a layer gets that are per position, not per row, whatever their first dimension.
_NOT_PER_ROW = frozenset({"cache_position", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"})


class LayerMajorError(RuntimeError):
    """Layer-major cannot run on this model; the message says why."""


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: transformers' GradientCheckpointingLayer modules, outermost ones only."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found: list[torch.nn.Module] = []

    def walk(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(child, GradientCheckpointingLayer):
                found.append(child)
            else:
                walk(child)

    walk(model)
    return found


def _held_params(layer: torch.nn.Module) -> list[Any]:
    # Persistent parameters never leave the device and external ones are their owner's to release.
    return [p for p in layer.parameters() if hasattr(p, "ds_active_sub_modules")
            and not getattr(p, "ds_persist", False) and not getattr(p, "is_external_param", False)]


class Holds:
    """At most one layer's parameters kept gathered across its micro-batches (see the module)."""

    def __init__(self, coordinator: Callable[[], Any]) -> None:
        self.coordinator = coordinator  # ZeRO-3's PartitionedParameterCoordinator, looked up when releasing
        self.held: torch.nn.Module | None = None
        self.params: list[Any] = []  # the held layer's, as marked: exactly these are unmarked

    def begin(self, layer: torch.nn.Module) -> None:
        if self.held is layer:
            return
        self.settle()
        self.held, self.params = layer, _held_params(layer)
        for p in self.params:
            p.ds_active_sub_modules.add(HOLD_MARK)

    def end(self, layer: torch.nn.Module) -> None:
        if self.held is layer:
            self.settle()

    def settle(self) -> None:
        """Release the held layer, if any: each of its parameters that no module is using any more."""
        params, self.held, self.params = self.params, None, []
        if not params:
            return
        release = self.coordinator()._PartitionedParameterCoordinator__release_param
        for p in params:
            p.ds_active_sub_modules.discard(HOLD_MARK)
            release(p)  # ZeRO-3's own check: only a gathered parameter that no module is using


class _OnGradient(torch.autograd.Function):
    """Identity in forward; in backward, `action(layer)` when the gradient reaches it. On a layer's stacked output
    (Holds.begin) that is before any of the layer's micro-batches runs backward; on its stacked input (Holds.end),
    only after all of them, since the input's gradient is whole only then."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, action: Callable[[torch.nn.Module], None],
                layer: torch.nn.Module) -> torch.Tensor:
        ctx.action, ctx.layer = action, layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.action(ctx.layer)
        return grad, None, None


def _split(name: str, value: Any, rows: int, groups: int) -> list[Any]:
    """`value` as each micro-batch's: a tensor (or a tuple of them, e.g. rotary cos/sin) with the stacked rows cut
    in `groups`, a scalar or None as it is; anything else (a dict, a block mask, a cache) may hold per-row tensors
    this cannot cut, so it is refused, naming the argument."""
    if isinstance(value, torch.Tensor):
        per_row = value.dim() and value.shape[0] == rows and name not in _NOT_PER_ROW
        return list(value.chunk(groups)) if per_row else [value] * groups
    if isinstance(value, (tuple, list)):
        parts = [_split(name, v, rows, groups) for v in value]
        return [type(value)(p[g] for p in parts) for g in range(groups)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return [value] * groups
    raise LayerMajorError(f"training.layerMajor: a decoder layer gets {name}, a {type(value).__name__}, which memstrata "
                          "cannot cut into micro-batches (a flex-attention block mask or a cache?); set layerMajor: "
                          "false")


class LayerMajor:
    """Installed on a model: while `step()` is open, its forward runs the stacked micro-batches layer by layer."""

    def __init__(self, model: Any, coordinator: Callable[[], Any], groups: int) -> None:
        self.groups, self.holds = groups, Holds(coordinator)
        self.layers = decoder_layers(model)
        if not self.layers:
            raise LayerMajorError(f"training.layerMajor: {type(model).__name__} has no transformers "
                                  "GradientCheckpointingLayer decoder layers to run one micro-batch at a time; set "
                                  "layerMajor: false")
        self.head = model.get_output_embeddings()
        self.active = False
        for layer in self.layers:
            # An instance attribute: ZeRO-3's hooks stay around the one call; the class keeps its forward.
            setattr(layer, "forward", functools.partial(self._forward, layer))

    @classmethod
    def install(cls, engine: Any, groups: int) -> "LayerMajor":
        """On a ZeRO-3 engine's model, `groups` micro-batches a step."""
        return cls(engine.module, lambda: engine.optimizer.parameter_offload.get_param_coordinator(), groups)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """The forward inside runs `groups` stacked micro-batches layer-major, and the head averages their losses."""
        self.active = True
        setattr(self.head, "memstrata_groups", self.groups)
        try:
            yield
        finally:
            self.active = False
            setattr(self.head, "memstrata_groups", 1)

    def backward(self, engine: Any, loss: torch.Tensor) -> None:
        """`engine.backward(loss)`, and after it no layer stays gathered into the update (the first layer's hold
        is still set where its input needs no gradient), whatever backward raised."""
        try:
            engine.backward(loss)
        finally:
            self.holds.settle()

    def _forward(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        own = type(layer).forward
        if not self.active:  # evaluation, generation, export: one batch as it comes
            return own(layer, *args, **kwargs)
        if not args or not isinstance(args[0], torch.Tensor):
            raise LayerMajorError(f"training.layerMajor: {type(layer).__name__} is not given its hidden states as its "
                                  "first positional argument; set layerMajor: false")
        hidden, rest = args[0], args[1:]
        rows = hidden.shape[0]
        if rows % self.groups:
            raise LayerMajorError(f"training.layerMajor: {rows} stacked rows are not {self.groups} equal "
                                  "micro-batches")
        hidden = _OnGradient.apply(hidden, self.holds.end, layer)
        pieces = list(zip(*(_split(f"argument {i}", a, rows, self.groups) for i, a in enumerate((hidden, *rest)))))
        keywords = {k: _split(k, v, rows, self.groups) for k, v in kwargs.items()}
        self.holds.begin(layer)
        try:
            outputs = [own(layer, *pieces[g], **{k: v[g] for k, v in keywords.items()}) for g in range(self.groups)]
        finally:
            self.holds.end(layer)
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise LayerMajorError(f"training.layerMajor: {type(layer).__name__} returns "
                                  f"{type(outputs[0]).__name__}, not a hidden-state tensor; set layerMajor: false")
        return _OnGradient.apply(torch.cat(outputs), self.holds.begin, layer)
