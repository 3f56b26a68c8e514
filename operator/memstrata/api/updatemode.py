"""spec.training.update: how the optimizer update meets the next step (memstrata.runtime.swap.delayed).

`exact` (the default): every step's gradient is taken at the weights its previous update left, ZeRO-3's numerics
unchanged. `delayed`, asked for by name (ZeRO-Offload's delayed parameter update): step t's update runs beside
step t+1's forward and backward, whose gradient is therefore taken at the weights from before it (one step
stale); its I/O hides behind a whole step of compute. It needs memstrata's engine, and the plan counts the 16-bit
shadows of the weights it writes while the backward still reads the old ones.
"""
from __future__ import annotations

from typing import Literal

from memstrata.api.base import cel

__all__ = ["DELAYED_UPDATE_RULE", "UpdateMode", "update_refusal"]

UpdateMode = Literal["exact", "delayed"]

# `update_refusal` for the API server, on the whole spec (memstrata.api.crd.spec_rules).
DELAYED_UPDATE_RULE = cel(
    "!has(self.training.update) || self.training.update != 'delayed' || "
    "!has(self.memory) || !has(self.memory.engine) || self.memory.engine == 'memstrata'",
    "training.update delayed needs memory.engine memstrata (stock ZeRO-3 has no delayed update)", ".training.update")


def update_refusal(*, update: UpdateMode, engine: str) -> str | None:
    """Why `update` cannot run on `engine`, in words, or None."""
    if update == "delayed" and engine != "memstrata":
        return f"delayed needs memory.engine memstrata, not {engine} (stock ZeRO-3 has no delayed update)"
    return None
