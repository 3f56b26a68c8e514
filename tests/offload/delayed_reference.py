"""The delayed update written out in plain PyTorch: pipeline_worker.py's gpt-tiny run, with no ZeRO-3 and no
memstrata, as the reference the engine's delayed update is held to (tests/offload/test_delayed_update.py).

    python delayed_reference.py OUT STEPS delayed|exact SUB_GROUP

The same model, data and seed as pipeline_worker.py; bf16 weights, fp32 master weights stepped by DeepSpeed's CPU
Adam kernel (the one ZeRO-3's offloaded update runs) with the harness's AdamW settings, ZeRO-3's global norm (per
sub-group, cut by memstrata's rule for a unit of SUB_GROUP elements: its parameters' fp64 norms squared and summed, then an fp32 root; the sub-groups'
combined by `combine_grad_norm_groups`) and clipping formula, and the master rounded into the bf16 weights. `exact`: each update goes into the weights at once
(what the in-place engine does); `delayed`: step t's update goes in at step t+1's step(), after step t+1's forward
and backward (so step t+1's gradient is taken at the weights from before it), the last one at the end.
Writes OUT (JSON): the loss of every step and a digest of the final bf16 weights, as pipeline_worker.py does.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def main() -> None:
    out, steps, mode, unit = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.utils import combine_grad_norm_groups

    from memstrata.api.architecture import PRESETS
    from memstrata.plan.accounting import group_tensors
    from memstrata.runtime.train.model.hfmodel import random_model

    torch.manual_seed(0)
    model = random_model(PRESETS["gpt-tiny"], 32, 1234).to(torch.bfloat16)
    params = list(model.parameters())
    groups = group_tensors([p.numel() for p in params], unit)  # memstrata's cut of ZeRO-3's sub-groups
    # One flat fp32 master per sub-group, as ZeRO-3 steps them: the Adam kernel's vector and tail elements are then
    # the same ones.
    master = [torch.cat([params[i].detach().float().reshape(-1) for i in g]) for g in groups]
    adam = DeepSpeedCPUAdam(master, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, adamw_mode=True)
    gen = torch.Generator().manual_seed(7)
    losses: list[float] = []

    def apply() -> None:
        with torch.no_grad():
            for g, m in zip(groups, master):
                for i, part in zip(g, m.split([params[i].numel() for i in g])):
                    params[i].copy_(part.view_as(params[i]))

    for step in range(1, steps + 1):
        ids = torch.randint(0, 200, (2, 32), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss.detach().float()))
        grads = [p.grad.float() for p in params]
        for p in params:
            p.grad = None
        if mode == "delayed" and step > 1:
            apply()  # the update of step - 1, joined at this step()
        norm = combine_grad_norm_groups([_norm([grads[i] for i in g]) for g in groups])
        clip = torch.clamp(((norm / 1.0) + 1e-6) / 1.0, min=1.0)  # ZeRO-3's unscale_and_clip_grads, loss scale 1
        for g, m in zip(groups, master):
            m.grad = torch.cat([grads[i].reshape(-1) for i in g]).mul_(1. / clip)
        adam.step()
        if mode == "exact":
            apply()
    apply()  # delayed: the last update, joined when the weights are read
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().float().contiguous().numpy().tobytes())
    Path(out).write_text(json.dumps({"losses": losses, "weights": digest.hexdigest()}))


def _norm(grads: list) -> object:
    """ZeRO-3's norm of one sub-group (`complete_grad_norm_calculation_for_cpu_offload`): its parameters' fp64
    norms squared and summed, then an fp32 root."""
    import torch

    from memstrata.runtime.swap.gradients import partition_norm

    total = 0.0
    for g in grads:
        total = total + partition_norm(g) ** 2
    return torch.tensor([float(total)], dtype=torch.float32)[0] ** 0.5


if __name__ == "__main__":
    main()
