"""What a checkpoint takes from the engine besides the model, and puts back: the RNG streams, each optimizer
sub-group through ZeRO-3's own swap-in and release calls, and DeepSpeedCPUAdam's step count.

For memstrata.runtime.train.checkpoints.checkpoint, which decides when and where they are written.
"""
from __future__ import annotations

import base64
import logging
import random
from collections.abc import Callable
from typing import Any

__all__ = ["SubGroups", "capture_rng", "replay_cpu_adam_steps", "restore_rng"]


# --- RNG -----------------------------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    """Every RNG a step may draw from (dropout, the data loader's shuffles), as JSON."""
    import numpy as np
    import torch

    np_state: Any = np.random.get_state()  # legacy tuple (name, keys, pos, has_gauss, cached_gaussian)
    py_state: Any = random.getstate()
    out: dict[str, Any] = {
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's own device only: a rank draws on cuda:LOCAL_RANK alone, and a state per visible GPU would not
        # load where another number of GPUs is visible (a resumed pod may see one where the first saw eight).
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return out


def restore_rng(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))

    def tensor(b64: str) -> "torch.Tensor":
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    saved = state.get("cuda")
    if saved and torch.cuda.is_available():
        if isinstance(saved, list):  # written by an earlier memstrata: one per visible GPU, this rank's at its index
            index = torch.cuda.current_device()
            if index >= len(saved):
                logging.getLogger(__name__).warning(
                    "memstrata: the checkpoint holds %d GPU random states (one per GPU its writer saw) and this rank "
                    "is on GPU %d: dropout draws differ from an uninterrupted run's", len(saved), index)
                return
            saved = saved[index]
        torch.cuda.set_rng_state(tensor(saved))


# --- optimizer sub-groups ---------------------------------------------------------------------------------
def _scalar(value: Any) -> dict[str, Any]:
    import torch

    if torch.is_tensor(value):
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    return {"value": value}


def _unscalar(saved: dict[str, Any], device: Any) -> Any:
    import torch

    if "tensor" in saved:
        return torch.tensor(saved["tensor"], dtype=getattr(torch, saved["dtype"]), device=device)
    return saved["value"]


class SubGroups:
    """ZeRO-3's optimizer sub-groups of one rank, each brought in and put back through ZeRO-3's own calls."""

    def __init__(self, zero: Any) -> None:
        from memstrata.runtime.swap.overlap import settle

        settle(zero)  # an update still running beside the forward is finished before any of its state is read
        self.zero = zero

    def __len__(self) -> int:
        return len(self.zero.fp16_groups)

    def numels(self) -> list[int]:
        return [int(n) for n in self.zero.fp16_partitioned_groups_flat_numel]

    def swapped(self, i: int) -> bool:
        return bool(self.zero._swappable_optimizer_subgroup(i))

    def read(self, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensors, scalars) of sub-group i, resident until `release(i)`."""
        if self.swapped(i):
            self.zero._optimizer_states_and_gradient_swap_in(i)
        fp32 = self.zero.fp32_partitioned_groups_flat[i]
        tensors: dict[str, Any] = {"master": fp32.data}
        scalars: dict[str, Any] = {}
        for key, value in self.zero.optimizer.state.get(fp32, {}).items():
            if hasattr(value, "numel") and value.numel() == fp32.numel():
                tensors[f"state.{key}"] = value
            else:
                scalars[key] = _scalar(value)
        return tensors, scalars

    def release(self, i: int) -> None:
        # The NVMe copy is current: nothing is written back. (A sub-group kept in DRAM has nothing to release.)
        if self.swapped(i):
            self.zero._release_swap_buffers(i)

    def write(self, i: int, tensors: Callable[[str], Any], names: list[str], scalars: dict[str, Any]) -> None:
        """Fill sub-group i from a checkpoint, re-derive its 16-bit partitions, put it back."""
        if self.swapped(i):
            self.zero._optimizer_states_and_gradient_swap_in(i)
        fp32 = self.zero.fp32_partitioned_groups_flat[i]
        fp32.data.copy_(tensors("master"))
        state = self.zero.optimizer.state[fp32]
        for name in names:
            if name.startswith("state."):
                key, value = name.removeprefix("state."), tensors(name)
                if key in state and hasattr(state[key], "copy_"):
                    state[key].copy_(value)
                else:  # a copy: the loaded tensor maps the checkpoint file, which must not stay mapped
                    state[key] = value.to(fp32.device, copy=True)
                del value
        for key, saved in scalars.items():
            state[key] = _unscalar(saved, fp32.device)
        self.zero._reassign_or_swap_out_partitioned_parameters(i)
        if self.swapped(i):
            self.zero._optimizer_states_and_gradient_swap_out(i)


def replay_cpu_adam_steps(optimizer: Any, steps: int) -> None:
    """Make a fresh DeepSpeedCPUAdam's bias correction bit-identical to that of the run that saved.

    Its C++ side keeps beta^t as a running product, multiplied once per step; a fresh optimizer whose first
    step is k+1 computes pow(beta, k+1) instead, which can differ in the last bit, and the losses of a resumed
    run would drift from the uninterrupted run's within a step. Stepping its counter 1..k on a one-element
    dummy with lr 0 rebuilds the same product (the dummy is the only tensor touched)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    import torch

    if not isinstance(optimizer, DeepSpeedCPUAdam) or steps <= 0:
        return
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    p, g, m, v = (torch.zeros(1) for _ in range(4))
    for step in range(1, steps + 1):
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, 0.0, beta1, beta2, group["eps"], 0.0,
                                          group["bias_correction"], p, g, m, v)
