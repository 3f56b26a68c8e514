"""A memstrata run of the tiny job with torch's pinning replaced by one that pins as torch's caching host allocator
does (each request rounded up to a power of two) and counts: `pin_worker.py JOB.yaml NVME_DIR OUT.json`.

DeepSpeed pins through its accelerator's `pin_memory` (and `pin_empty*`, through `_pin_fresh`): torch's allocator on a
GPU, a no-op on the CPU accelerator. The stand-in, on the accelerator's class, shows whether any pin still reaches
it, and what it would have cost. OUT.json: the stand-in's counts, the
run's report, and the plan's DRAM bytes per category.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def power_of_two_pins(counts: dict[str, int]) -> None:
    import torch
    from deepspeed.accelerator import get_accelerator

    def rounded(nbytes: int) -> int:
        return 1 << max(0, (nbytes - 1).bit_length())

    def pin(self: Any, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        asked = tensor.numel() * tensor.element_size()
        counts["pins"] += 1
        counts["asked_bytes"] += asked
        counts["pinned_bytes"] += rounded(asked)
        return tensor.clone()

    def empty(self: Any, tensor: torch.Tensor, shape: Any) -> torch.Tensor:
        return pin(self, tensor.new_empty(shape))

    # On the class: what the accelerator does with a pin that memstrata does not take (its instance methods, while
    # the model and the engine are built) is what stock's CUDA accelerator does, torch's pinning.
    accelerator = type(get_accelerator())
    accelerator.pin_memory, accelerator._pin_fresh = pin, empty  # type: ignore[method-assign]


def main() -> int:
    job_path, nvme, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    os.environ["DS_ACCELERATOR"] = "cpu"
    from memstrata.api import load_job
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job
    from memstrata.runtime.train.local import run_local

    counts = {"pins": 0, "asked_bytes": 0, "pinned_bytes": 0}
    power_of_two_pins(counts)
    job = load_job(job_path)
    plan = plan_job(job.spec, local_inventory(nvme))
    report = out.with_suffix(".report.json")
    rc = run_local(job, plan, nvme_path=nvme, report_json=report)
    out.write_text(json.dumps({
        "rc": rc, "torch_pins": counts, "report": json.loads(report.read_text()) if report.exists() else None,
        "plan_dram": {c.category: c.on("dram") for c in plan.categories},
    }))
    return rc


if __name__ == "__main__":
    sys.exit(main())
