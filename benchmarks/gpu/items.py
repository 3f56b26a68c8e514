"""What benchmarks/gpu/check.py runs, in order of importance, for a GPU machine and for the CPU.

An item is the GPU tests, or one FineTuneJob: a base job of the profile (model, length, batch, steps) with the
item's engine, DRAM budget and changes. `plan_only` items are answered by the planner alone (a refusal that is
itself the result). The limits are each item's own; the profile's budget bounds the whole check.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Item:
    name: str
    kind: str  # "tests" or "run"
    limit_seconds: float
    least_seconds: float = 20.0  # not started with less of the budget left
    engine: str = "memstrata"
    budget: str = ""  # memory.dramBudget
    training: dict[str, Any] = field(default_factory=dict)  # changes to spec.training
    dataset: dict[str, Any] = field(default_factory=dict)  # changes to spec.dataset
    model: dict[str, Any] = field(default_factory=dict)  # instead of the profile's model
    memory: dict[str, Any] = field(default_factory=dict)  # more of spec.memory
    export: bool = False  # write spec.output, then reload it with transformers
    plan_only: bool = False
    expect: str = "completed"  # plan_only: "refused" or "fits"
    note: str = ""

    def describe(self) -> dict[str, Any]:
        return {"engine": self.engine if self.kind == "run" else None, "budget": self.budget or None,
                "note": self.note}


@dataclass(frozen=True)
class Profile:
    name: str
    result_name: str
    model: dict[str, Any]
    training: dict[str, Any]
    gpus: int
    budget_seconds: float
    big: str  # a DRAM budget where both engines fit with state on NVMe
    only_memstrata: str  # one where only memstrata's plan fits
    dram: str  # one where everything fits in DRAM
    long: dict[str, Any]  # spec.training of the long-context runs
    small: dict[str, Any]  # the small runs (fp16, LoRA, export): model, budget, training
    limits: dict[str, float]

    @property
    def items(self) -> tuple[Item, ...]:
        return _items(self)


def _items(p: Profile) -> tuple[Item, ...]:
    """The check's items, most important first."""
    big, only_memstrata, dram, long, small, limits = p.big, p.only_memstrata, p.dram, p.long, p.small, p.limits
    run = limits["run"]
    return (
        Item("gpu-tests", "tests", limits["tests"], note="pytest -m gpu: skipped without a GPU"),
        Item(f"memstrata-{big}", "run", run, budget=big, note="NVMe-heavy; both engines fit"),
        Item(f"stock-{big}", "run", run, engine="deepspeed", budget=big, note="NVMe-heavy; both engines fit"),
        # The delayed update, asked for by name: on a GPU its backward's gradient writes run on the autograd
        # device thread and wait there; the update's Adam and I/O hide behind a whole step.
        Item(f"memstrata-{big}-delayed", "run", run, budget=big, training={"update": "delayed"},
             note="spec.training.update delayed: each update beside the next forward and backward"),
        Item(f"memstrata-{only_memstrata}", "run", run, budget=only_memstrata, note="stock's plan does not fit"),
        # Issue 31's llama3.2-1b at 10 and 14 GiB, with gradient accumulation: weights on NVMe run layer-major.
        Item(f"memstrata-{big}-accum4", "run", run, budget=big, training={"microBatch": 2, "gradientAccumulation": 4},
             note="4 micro-batches a step: layer-major where weights are on NVMe"),
        Item(f"stock-{big}-accum4", "run", run, engine="deepspeed", budget=big,
             training={"microBatch": 2, "gradientAccumulation": 4}, note="4 micro-batches a step, one at a time"),
        Item(f"stock-{only_memstrata}", "run", 30, engine="deepspeed", budget=only_memstrata, plan_only=True,
             expect="refused", note="the planner's answer"),
        Item(f"memstrata-{dram}", "run", run, budget=dram, note="everything in DRAM"),
        Item(f"stock-{dram}", "run", run, engine="deepspeed", budget=dram, note="everything in DRAM"),
        # As benchmarks/longctx runs them: every byte of state in DRAM, only the activations differ; stock with
        # Hugging Face's checkpointing (on the device) and its whole-logits loss.
        Item("memstrata-long", "run", run, training=long, memory={"nvmeNamespaces": 0},
             note="long context: checkpoints in memstrata's pool, chunked loss"),
        Item("stock-long", "run", run, engine="deepspeed", training={**long, "lossChunkTokens": 0},
             memory={"nvmeNamespaces": 0}, note="long context: HF checkpointing and loss"),
        Item("memstrata-fp16", "run", limits["small"], budget=small["budget"], model=small["model"],
             training={**small["training"], "precision": "fp16"}, note="fp16: the one-pass overflow check"),
        Item("memstrata-lora", "run", limits["small"], budget=small["budget"], model=small["model"],
             training={**small["training"], "method": "lora", "learningRate": 3e-3}, note="LoRA adapters"),
        Item("memstrata-export", "run", limits["small"], budget=small["budget"], model=small["model"],
             training=small["training"], dataset={"validationSplit": 0.1}, export=True,
             note="the model saved, reloaded by transformers"),
    )


GPU = Profile(
    name="gpu", result_name="gpu-check", model={"preset": "llama3.2-1b"}, gpus=1, budget_seconds=480,
    training={"sequenceLength": 2048, "microBatch": 8, "steps": 3}, big="14Gi", only_memstrata="10Gi", dram="80Gi",
    long={"sequenceLength": 32768, "microBatch": 1},
    small={"model": {"preset": "gpt-125m"}, "budget": "1Gi",
           "training": {"sequenceLength": 512, "microBatch": 4, "steps": 8}},
    limits={"tests": 150, "run": 150, "small": 90})

CPU = Profile(
    name="cpu", result_name="gpu-check-cpu", model={"preset": "gpt-tiny"}, gpus=0, budget_seconds=900,
    training={"sequenceLength": 128, "microBatch": 4, "steps": 3}, big="8Mi", only_memstrata="4Mi", dram="64Mi",
    long={"sequenceLength": 512, "microBatch": 1},
    small={"model": {"preset": "gpt-tiny"}, "budget": "8Mi",
           "training": {"sequenceLength": 128, "microBatch": 4, "steps": 6}},
    limits={"tests": 300, "run": 180, "small": 180})


def manifest(item: Item, profile: Profile, output: Path | None) -> str:
    """The item's FineTuneJob as YAML."""
    training = {**profile.training, "precision": "bf16", "activationCheckpointing": True, "learningRate": 1e-3,
                "seed": 1234, **item.training}
    spec: dict[str, Any] = {
        "model": item.model or profile.model, "dataset": {"synthetic": "arithmetic", **item.dataset},
        "training": training, "resources": {"gpus": profile.gpus},
        "memory": {"engine": item.engine, **({"dramBudget": item.budget} if item.budget else {}), **item.memory}}
    if output is not None:
        spec["output"] = {"path": str(output)}
    return yaml.safe_dump({"apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob",
                           "metadata": {"name": f"check-{item.name}".lower()}, "spec": spec})


def plan_verdict(job_path: Path, nvme: Path, gpu: bool, expect: str) -> dict[str, Any]:
    """The planner's answer for the job on this machine, as a check result (ok: the answer `expect`ed)."""
    from memstrata.api import load_job
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job

    nvme.mkdir(parents=True, exist_ok=True)
    if gpu:
        from memstrata.runtime.train.local import torch_gpus

        node = local_inventory(nvme, gpus=torch_gpus)
    else:
        node = local_inventory(nvme)
    plan = plan_job(load_job(job_path).spec, node)
    return {"ok": plan.feasible == (expect == "fits"),
            "status": "refused by the planner" if not plan.feasible else "fits",
            "verdict": plan.verdict(), "plan_dram_bytes": plan.bytes_on("dram"),
            "plan_nvme_bytes": plan.bytes_on("nvme")}


def cannot_run(item: Item, cpu: bool) -> str | None:
    """Why `item` cannot run on this machine at all (not a failure: the machine lacks what it needs), or None."""
    if cpu and item.training.get("precision") == "fp16":
        import torch

        try:
            supported = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:  # noqa: BLE001 - a torch without the query: assume not
            supported = False
        if not supported:
            return ("this CPU has no fp16 support in oneDNN, so DeepSpeed's CPU accelerator refuses fp16; the fp16 "
                    "run is for a GPU (or a CPU that has it)")
    return None


def gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a driver that does not answer: no GPU to name
        return None
