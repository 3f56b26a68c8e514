"""One long-context run: a FineTuneJob manifest trained by the local recipe (what `memstrata run` does), with
the per-step throughput, the run's report and the GPU peak written as JSON.

    python benchmarks/longctx/worker.py --job job.yaml --nvme-path DIR --out result.json \
        [--checkpointing recipe|deepspeed-cpu|hf-offload] [--cxl-nodes 2,3] [--gpu]

`--checkpointing recipe` leaves the recipe as it is (memstrata: its activation offload; stock: Hugging Face's
torch checkpoint). The other two keep the recipe and replace only the function every checkpointed layer runs
through, once the model is built: `deepspeed-cpu` is DeepSpeed's own activation checkpointing configured from
the ds_config's `activation_checkpointing` section with `cpu_checkpointing` on; `hf-offload` is transformers'
`activation_checkpointing_enable(offload=True)` (torch's save_on_cpu, pinned where there is an accelerator).
`--cxl-nodes`: the NUMA nodes memstrata interleaves the activation pool over (MEMSTRATA_CXL_NODES, as the
device plugin would set it); without it the plan is made as if the node had no CXL memory, so the pool is DRAM.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

# The ds_config section DeepSpeed documents for activation checkpointing: checkpoints copied to the CPU, not
# partitioned (one rank, no model parallelism), no contiguous buffer (that needs partitioning).
DS_CPU_CHECKPOINTING = {"partition_activations": False, "cpu_checkpointing": True,
                        "contiguous_memory_optimization": False, "number_checkpoints": None,
                        "synchronize_checkpoint_boundary": False, "profile": False}


def replace_checkpointing(mode: str) -> None:
    """Wrap hfmodel.build_model (the recipe imports it when it builds the engine) so the model it returns
    checkpoints its layers through `mode`'s function instead."""
    import memstrata.runtime.train.model.hfmodel as hfmodel

    built = hfmodel.build_model

    def build_model(config: Any, ds_config: dict[str, Any], dtype: Any, **kwargs: Any) -> Any:
        if not kwargs.get("checkpointing"):
            raise SystemExit(f"--checkpointing {mode} needs spec.training.activationCheckpointing: true")
        model = built(config, ds_config, dtype, **kwargs)
        if mode == "deepspeed-cpu":
            import deepspeed

            # The same dict goes on to deepspeed.initialize, so the engine's config records the section too.
            ds_config["activation_checkpointing"] = dict(DS_CPU_CHECKPOINTING)
            deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)
            model._set_gradient_checkpointing(enable=True,
                                              gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)
        else:
            model.activation_checkpointing_enable(offload=True)
        return model

    hfmodel.build_model = build_model


def plan_for(job: Any, nvme_path: Path, cxl_nodes: list[int]) -> Any:
    """The plan `memstrata run` would make for `job` here; with no `cxl_nodes`, as if the node had no CXL memory
    (so memstrata's activation pool is DRAM even on a host that has some)."""
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job
    from memstrata.runtime.train.local import torch_gpus

    node = local_inventory(nvme_path, gpus=torch_gpus)
    if not cxl_nodes:
        node = node.model_copy(update={"cxl_nodes": []})
    return plan_job(job.spec, node)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", type=Path, required=True)
    ap.add_argument("--nvme-path", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--checkpointing", choices=["recipe", "deepspeed-cpu", "hf-offload"], default="recipe")
    ap.add_argument("--cxl-nodes", default="", help="comma-separated NUMA nodes for memstrata's activation pool")
    ap.add_argument("--gpu", action="store_true", help="train on cuda:0 (the job must ask for a GPU)")
    args = ap.parse_args(argv)
    cxl = [int(n) for n in args.cxl_nodes.split(",") if n.strip()]
    # The benchmark's process runner says cpu for every child; a GPU run must say otherwise before DeepSpeed loads.
    os.environ["DS_ACCELERATOR"] = "cuda" if args.gpu else "cpu"
    if cxl:
        from memstrata.api.inventory import ENV_CXL_NODES

        os.environ[ENV_CXL_NODES] = ",".join(map(str, cxl))

    from memstrata.api import load_job
    from memstrata.cli.modelshape import with_model_shape
    from memstrata.runtime.train.local import run_local

    job = load_job(args.job)
    job.spec = with_model_shape(job.spec)
    plan = plan_for(job, args.nvme_path, cxl)
    result: dict[str, Any] = {"checkpointing": args.checkpointing, "cxl_nodes": cxl, "steps": []}
    if not plan.feasible:
        result["error"] = f"no plan: {plan.verdict()}"
        args.out.write_text(json.dumps(result))
        return 2
    if args.checkpointing != "recipe":
        replace_checkpointing(args.checkpointing)

    cpu = [time.process_time()]

    def on_report(r: Any) -> None:
        # CPU seconds of this process (all its threads) since the previous report: what a step cost, less exposed
        # than its wall time to whatever else the machine runs. The first step's includes the setup.
        now = time.process_time()
        if r.stage == "training":
            result["steps"].append({"step": r.step, "loss": r.loss, "tokens_per_second": r.tokens_per_second,
                                    "cpu_seconds": now - cpu[-1]})
        cpu.append(now)

    report = args.out.with_suffix(".report.json")
    errors: list[str] = []
    rc = run_local(job, plan, nvme_path=args.nvme_path, report_json=report, on_report=on_report,
                   on_error=errors.append)
    result.update(rc=rc, plan_dram_bytes=plan.bytes_on("dram"), plan_hbm_bytes=plan.bytes_on("hbm"))
    if errors:
        result["error"] = errors[-1]
    if report.exists():
        result["report"] = json.loads(report.read_text())
    # The kernel's own high-water mark of this process's RSS (VmHWM): exact, where a sampler of the process tree
    # can count a vfork'd child (DeepSpeed's CPU accelerator runs `numactl --hardware` during training) that
    # still shares this process's memory as a second copy of it.
    result["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if args.gpu:
        import torch

        from memstrata.runtime.train.observe.device import hbm_peak_bytes

        # What the process held on the device (reserved by torch's allocator, and outside it: context, NCCL), and
        # what its tensors held at most, for comparison with figures that report only the latter.
        hbm = (result.get("report") or {}).get("strata", {}).get("hbm", {}).get("peak_bytes", 0)
        result["gpu_peak_bytes"] = max(hbm, hbm_peak_bytes("cuda:0"))
        result["gpu_allocated_peak_bytes"] = torch.cuda.max_memory_allocated()
    args.out.write_text(json.dumps(result))
    return rc


if __name__ == "__main__":
    sys.exit(main())
