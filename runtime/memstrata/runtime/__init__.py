"""memstrata's runtime. `initialize` (a drop-in for `deepspeed.initialize`) is loaded lazily, so
importing this package never imports torch or DeepSpeed (the native façades must work without them)."""
from typing import Any

__all__ = ["initialize"]


def __getattr__(name: str) -> Any:
    if name == "initialize":
        from memstrata.runtime.swap.integration import initialize

        return initialize
    raise AttributeError(f"module 'memstrata.runtime' has no attribute {name!r}")
