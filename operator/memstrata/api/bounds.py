"""Bounds on the counts of a job, far past any real one, so that a typo (steps: 1e21) is refused naming its field
instead of being planned, scheduled and shown with an ETA of billions of hours: ten million optimizer steps
(years of the fastest steps), 65,536 sequences per micro-batch or accumulation, and a seed every RNG takes
(numpy's are 32-bit)."""
from __future__ import annotations

from typing import Final

MAX_STEPS: Final = 10_000_000
MAX_BATCH: Final = 65_536
MAX_SEED: Final = (1 << 32) - 1
