"""One-pass inf/nan check over a gradient buffer, with no temporaries.

DeepSpeed's `has_overflow` runs `isinf().any()` and `isnan().any()`: two
full-size bool tensors per check. Here host buffers are scanned once by the
native kernel (vectorized, GIL released), counting infs and nans. A CUDA
tensor is reduced on its device with one `aminmax` (nan propagates, inf shows
as an extreme), which allocates two scalars, not a copy of the gradients.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from memstrata.runtime import _native
from memstrata.runtime.strata.buffers import as_byte_view, is_torch_tensor

__all__ = ["OverflowReport", "check_overflow", "has_overflow"]

_KINDS = {"float16": "f16", "half": "f16", "bfloat16": "bf16", "float32": "f32", "float": "f32",
          "float64": "f64", "double": "f64"}


@dataclass(frozen=True)
class OverflowReport:
    inf_count: int
    nan_count: int

    @property
    def overflow(self) -> bool:
        return self.inf_count > 0 or self.nan_count > 0


def _kind_of(buffer: Any, dtype: str | None) -> str:
    if dtype is None:
        dt = getattr(buffer, "dtype", None)
        if dt is None:
            raise TypeError("pass dtype= for a buffer that carries no dtype (float16, bfloat16, float32, float64)")
        dtype = str(dt).removeprefix("torch.")
    kind = _KINDS.get(str(dtype))
    if kind is None:
        raise ValueError(f"unsupported dtype {dtype!r}: expected float16, bfloat16, float32 or float64")
    return kind


def _cuda_report(tensor: Any) -> OverflowReport:
    torch = sys.modules["torch"]
    lo, hi = torch.aminmax(tensor.reshape(-1))
    lo_v, hi_v = float(lo), float(hi)
    nan = hi_v != hi_v or lo_v != lo_v
    inf = lo_v == float("-inf") or hi_v == float("inf")
    # One reduction cannot count; it answers "is there any" for each kind.
    return OverflowReport(inf_count=int(inf), nan_count=int(nan))


def check_overflow(buffer: Any, dtype: str | None = None) -> OverflowReport:
    """Count infs and nans in `buffer` (numpy array, torch tensor, or bytes-like with dtype=)."""
    kind = _kind_of(buffer, dtype)
    if is_torch_tensor(buffer) and buffer.device.type == "cuda":
        return _cuda_report(buffer)
    view = as_byte_view(buffer, writable=False, what="gradient buffer")
    n_inf, n_nan = _native.scan_nonfinite(view, kind)
    return OverflowReport(inf_count=n_inf, nan_count=n_nan)


def has_overflow(buffer: Any, dtype: str | None = None) -> bool:
    return check_overflow(buffer, dtype).overflow
