"""memstrata.runtime._native: the compiled engine (native/*.c, built as `_core` by the package
build). A Python package rather than a bare extension so that import-linter sees it and can hold
the rule that only the strata façades (memstrata.runtime.strata) import it."""
from memstrata.runtime._native._core import PAGE_SIZE, Region, Ring, Threads, buffer_address, scan_nonfinite

__all__ = ["PAGE_SIZE", "Region", "Ring", "Threads", "buffer_address", "scan_nonfinite"]
