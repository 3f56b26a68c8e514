"""memstrata.runtime.strata: one façade per native concern (nvme, numa, pinned, overflow,
extents). Only these modules import `memstrata.runtime._native` (import-linter holds that)."""
