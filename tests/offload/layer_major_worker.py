"""One fine-tune through FineTuneRecipe with what every step read of the weights:
`layer_major_worker.py JOB.yaml NVME_DIR OUT.json`.

Writes OUT.json: the plan's choice and weight placement, the step losses, and the NVMe bytes read for parameters
by each step (memstrata's per-swapper counters).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    job_file, nvme, out = (Path(a) for a in sys.argv[1:4])
    from memstrata.api import load_job
    from memstrata.cli.modelshape import with_model_shape
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job
    from memstrata.runtime.train.recipe import FineTuneRecipe

    job = load_job(job_file)
    job.spec = with_model_shape(job.spec)
    from memstrata.runtime.train.local import torch_gpus

    plan = plan_job(job.spec, local_inventory(nvme, gpus=torch_gpus))
    if not plan.feasible:
        raise SystemExit(f"does not fit: {plan.verdict()}")
    recipe = FineTuneRecipe(job, plan, nvme)
    recipe.setup()
    reads: list[int] = []

    def param_reads() -> int:
        status = recipe.memstrata_status()
        moved = status.nvme.by_kind.get("param") if status is not None else None
        return int(moved.read) if moved is not None else 0

    def on_step(_: object) -> None:
        reads.append(param_reads())

    try:
        start = param_reads()
        result = recipe.train(on_step)
        per_step = [b - a for a, b in zip([start, *reads], reads)]
        out.write_text(json.dumps({
            "layer_major": plan.layer_major, "runs_layer_major": recipe.runs_layer_major,
            "weights_on_nvme": plan.category("weights").on("nvme"),
            "checkpoints": plan.category("checkpoints").bytes,
            "losses": [s.loss for s in result.steps], "param_reads": per_step,
            "micro_batch_config": recipe.ds.config["train_micro_batch_size_per_gpu"] if recipe.ds else None,
        }))
    finally:
        recipe.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
