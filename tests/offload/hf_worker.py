"""One fine-tune of a Hugging Face model through FineTuneRecipe, in its own process (DeepSpeed's state is
per process): `hf_worker.py JOB.yaml NVME_DIR OUT_DIR`.

Writes OUT_DIR/result.json (validation losses before and after, step losses, the output status) and
OUT_DIR/logits.pt: the trained engine's logits on OUT_DIR/probe.pt's token ids, computed after training
and before the engine is torn down, for the test to compare with the saved model reloaded by transformers.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def status_param_bytes(recipe: object) -> int:
    status = recipe.memstrata_status()  # type: ignore[attr-defined]
    if status is None:
        return 0
    moved = status.nvme.by_kind.get("param")
    return int(moved.written) if moved is not None else 0


def main() -> int:
    job_file, nvme, out = (Path(a) for a in sys.argv[1:4])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from memstrata.api import load_job
    from memstrata.cli.modelshape import with_model_shape
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job
    from memstrata.runtime.train.recipe import FineTuneRecipe

    job = load_job(job_file)
    job.spec = with_model_shape(job.spec)
    plan = plan_job(job.spec, local_inventory(nvme))
    if not plan.feasible:
        raise SystemExit(f"does not fit: {plan.verdict()}")
    recipe = FineTuneRecipe(job, plan, nvme)
    recipe.load_data()
    recipe.setup()
    built = status_param_bytes(recipe)  # what building and loading wrote, before any step
    try:
        result = recipe.train(lambda s: None)
        after = result.validation_losses.get(job.spec.training.steps)
        status = recipe.save(len(result.steps), after)
        probe = torch.load(out / "probe.pt")
        assert recipe.engine is not None
        recipe.engine.eval()
        with torch.no_grad():
            logits = recipe.engine(input_ids=probe).logits.float()
        torch.save(logits, out / "logits.pt")
        (out / "result.json").write_text(json.dumps({
            "validation": {str(k): v for k, v in result.validation_losses.items()},
            "losses": [s.loss for s in result.steps],
            "output": status.model_dump(mode="json") if status else None,
            # What memstrata's NVMe engine moved for parameters (0 on the stock engine).
            "param_bytes_written": status_param_bytes(recipe),
            "param_bytes_written_at_setup": built,
        }))
    finally:
        recipe.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
