"""One memstrata run that edits a gradient through DeepSpeed's public API, then reads it back.

    python grad_edit_worker.py DEVICE SWAP_DIR OUT
After one backward, sets the full gradient of every parameter of one NVMe
sub-group to 0.5 with `deepspeed.utils.safe_set_full_grad` and reads them back
with `safe_get_full_grad`. Writes OUT (JSON): whether the original gradients
were non-zero, and what was read back.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "offload"))


def main() -> None:
    device, swap_dir, out = sys.argv[1:4]
    from harness import LONE_RANK, ds_config  # the same ds_config the comparison tests use

    for k, v in {**LONE_RANK, "DS_ACCELERATOR": "cpu"}.items():
        os.environ.setdefault(k, v)
    import torch
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    from memstrata.api.architecture import PRESETS
    from memstrata.runtime import initialize
    from memstrata.runtime.train.model.hfmodel import random_model

    arch = PRESETS["gpt-tiny"]
    model = random_model(arch, 32, 1234)
    Path(swap_dir).mkdir(parents=True, exist_ok=True)
    cfg = ds_config(arch, swap_dir=swap_dir, batch=2, precision="bf16", profile="tuned")
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                 swap={"nvme": [device]})
    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    opt = engine.optimizer
    group = next(i for i in range(len(opt.fp16_groups)) if opt._swappable_optimizer_subgroup(i))
    params = [p for p in opt.fp16_groups[group] if p.requires_grad]
    before = [safe_get_full_grad(p).clone() for p in params]
    for p in params:
        safe_set_full_grad(p, torch.full(p.ds_shape, 0.5))
    after = [safe_get_full_grad(p) for p in params]
    Path(out).write_text(json.dumps({
        "params": len(params),
        "before_nonzero": all(bool(g.abs().sum() > 0) for g in before),
        "after_all_half": all(bool((g == 0.5).all()) for g in after),
        "after_max_abs_diff_from_before": max(float((a - b).abs().max()) for a, b in zip(after, before)),
    }))
    engine.memstrata.close()


if __name__ == "__main__":
    main()
