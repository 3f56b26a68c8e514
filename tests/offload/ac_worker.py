"""A few steps of the tiny example through FineTuneRecipe, in its own process (DeepSpeed's state is per process):
`ac_worker.py JOB.yaml NVME_DIR OUT.json`.

Writes OUT.json: every step's loss and DeepSpeed's global gradient norm (as float.hex, so the test compares them
bit for bit), the norm of every parameter's full gradient at each update (read through DeepSpeed's
safe_get_full_grad just before engine.step applies it), and, on the memstrata engine, how many released parameter
buffers were still waiting for the pool after the run.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    job_file, nvme, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from memstrata.api import load_job
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job
    from memstrata.runtime.train.recipe import FineTuneRecipe

    job = load_job(job_file)
    plan = plan_job(job.spec, local_inventory(nvme))
    if not plan.feasible:
        raise SystemExit(f"does not fit: {plan.verdict()}")
    recipe = FineTuneRecipe(job, plan, nvme)
    recipe.setup()
    try:
        from deepspeed.utils import safe_get_full_grad

        engine = recipe.engine
        assert engine is not None
        grads: list[dict[str, str]] = []
        step = engine.step

        def step_recording_gradients(*args: object, **kwargs: object) -> object:
            norms = {}
            for name, param in engine.module.named_parameters():
                grad = safe_get_full_grad(param)
                norms[name] = "none" if grad is None else float(grad.float().norm()).hex()
            grads.append(norms)
            return step(*args, **kwargs)

        engine.step = step_recording_gradients
        result = recipe.train(lambda s: None)
        swapper = next((p.nvme_swapper for p in engine.module.parameters() if getattr(p, "nvme_swapper", None)),
                       None)
        out.write_text(json.dumps({
            "losses": [s.loss.hex() for s in result.steps],
            "grad_norms": [float(s.grad_norm).hex() if s.grad_norm is not None else None for s in result.steps],
            "param_grad_norms": grads,
            "lingering": len(getattr(swapper, "_lingering", [])) if swapper is not None else None,
        }))
    finally:
        recipe.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
