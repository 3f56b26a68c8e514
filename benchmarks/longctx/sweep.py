"""What the long-context benchmark runs, and how its records become the summary (pure: no torch, no processes).

Every contender trains the same model on the same synthetic data (seeded) with activation checkpointing on,
micro-batch 1, everything offloaded to the host (memory.nvmeNamespaces 0, so the plan of both engines puts the
weights, gradients and optimizer state in DRAM and only the activations differ):

- memstrata: memory.engine memstrata; each layer's checkpoint copied into the swap layer's pool in DRAM; the
  loss taken `lossChunkTokens` at a time.
- memstrata-cxl: the same with the pool interleaved over the host's CPU-less NUMA nodes (CXL); skipped where
  there are none.
- stock: memory.engine deepspeed (ZeRO-Infinity); Hugging Face's torch checkpoint (checkpoints stay on the
  compute device) and Hugging Face's loss (whole logits: lossChunkTokens 0).
- stock-ds-cpu-ckpt: stock with DeepSpeed's own activation checkpointing, `cpu_checkpointing: true`.
- stock-hf-offload: stock with transformers' `activation_checkpointing_enable(offload=True)`.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Contender:
    name: str
    engine: str  # spec.memory.engine
    checkpointing: str  # worker.py --checkpointing
    chunked_loss: bool  # lossChunkTokens as asked (True) or 0, Hugging Face's whole-logits loss (False)
    activations: str  # where the checkpoints live between forward and backward
    what: str


CONTENDERS = (
    Contender("memstrata", "memstrata", "recipe", True, "dram",
              "memstrata engine; checkpoints in its DRAM pool; chunked loss"),
    Contender("memstrata-cxl", "memstrata", "recipe", True, "cxl",
              "memstrata engine; checkpoints interleaved over the CXL NUMA nodes; chunked loss"),
    Contender("stock", "deepspeed", "recipe", False, "device",
              "stock ZeRO-3; HF torch checkpointing (on the compute device); HF loss"),
    Contender("stock-ds-cpu-ckpt", "deepspeed", "deepspeed-cpu", False, "cpu",
              "stock ZeRO-3; DeepSpeed activation checkpointing with cpu_checkpointing; HF loss"),
    Contender("stock-hf-offload", "deepspeed", "hf-offload", False, "cpu",
              "stock ZeRO-3; transformers activation_checkpointing_enable(offload=True); HF loss"),
)
BY_NAME = {c.name: c for c in CONTENDERS}
BASELINE = "stock"


def manifest(c: Contender, *, seq: int, steps: int, loss_chunk: int, model_path: str | None = None,
             preset: str | None = None, gpus: int = 0, seed: int = 1234) -> dict[str, Any]:
    """The FineTuneJob `c` runs at sequence length `seq` (a model directory or a preset, not both)."""
    if (model_path is None) == (preset is None):
        raise ValueError("give exactly one of model_path and preset")
    return {
        "apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob",
        "metadata": {"name": f"longctx-{c.name}-{seq}"},
        "spec": {
            "model": {"path": model_path} if model_path is not None else {"preset": preset},
            "dataset": {"synthetic": "arithmetic"},
            "training": {"sequenceLength": seq, "microBatch": 1, "steps": steps, "precision": "bf16", "seed": seed,
                         "activationCheckpointing": True, "lossChunkTokens": loss_chunk if c.chunked_loss else 0},
            "resources": {"gpus": gpus},
            "memory": {"engine": c.engine, "nvmeNamespaces": 0},
        },
    }


def cxl_candidates(numa: list[Any], cxl: list[Any]) -> list[int]:
    """The NUMA nodes memstrata-cxl interleaves over: the CXL nodes discovery found (CPU-less, backed by a CXL
    region), else any CPU-less node with memory (an emulated CXL expander); none on a plain host."""
    if cxl:
        return [c.numa_node for c in cxl]
    return [n.id for n in numa if not n.cpus and n.memory_bytes]


def steady(steps: list[dict[str, Any]], key: str = "tokens_per_second") -> float | None:
    """The median of `key` (tokens/s, CPU seconds) over the steps after the first (which pays for first-touch
    allocation and warm-up, and its CPU seconds for the setup); the first itself when it is the only one."""
    values = [s[key] for s in steps if s.get(key)]
    later = values[1:] or values
    return statistics.median(later) if later else None


def outcome(run: dict[str, Any]) -> str:
    """completed, OOM (killed under the cap), failed or skipped."""
    if run.get("skipped"):
        return "skipped"
    if run.get("ok"):
        return "completed"
    return "OOM" if run.get("oom_killed") else "failed"


def measured(runs: list[dict[str, Any]], contender: str, seq: int) -> dict[str, Any] | None:
    """The run that measures `contender` at `seq`: its capped run when that completed, else its run without
    the cap (made after an OOM), else None."""
    mine = [r for r in runs if r["contender"] == contender and r["seq"] == seq and r.get("ok")]
    mine.sort(key=lambda r: not r.get("capped"))
    return mine[0] if mine else None


def capped_run(runs: list[dict[str, Any]], contender: str, seq: int) -> dict[str, Any] | None:
    return next((r for r in runs if r["contender"] == contender and r["seq"] == seq and r.get("capped")), None)


def longest_under_cap(runs: list[dict[str, Any]], contender: str, lengths: list[int]) -> int | None:
    """The longest length `contender` completed under the cap with every shorter one completed too."""
    best = None
    for seq in sorted(lengths):
        r = capped_run(runs, contender, seq)
        if r is None or not r.get("ok"):
            break
        best = seq
    return best


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per length: memstrata vs stock (and vs every other contender) for throughput and peaks; per contender:
    the longest length it completed under the DRAM cap."""
    runs, lengths = results["runs"], results["lengths"]
    names = [c for c in results["contenders"] if c not in results.get("skipped_contenders", {})]
    per_length: dict[str, Any] = {}
    for seq in lengths:
        ms = measured(runs, "memstrata", seq)
        row: dict[str, Any] = {}
        for other in names:
            if other == "memstrata":
                continue
            o = measured(runs, other, seq)
            if ms is None or o is None:
                continue
            row[other] = {"tokens_per_second": _ratio(ms["tokens_per_second"], o["tokens_per_second"]),
                          "peak_rss": _ratio(ms["peak_rss_bytes"], o["peak_rss_bytes"]),
                          "cpu_seconds_per_step": _ratio(ms.get("cpu_seconds_per_step"), o.get("cpu_seconds_per_step")),
                          "gpu_peak": _ratio(ms.get("gpu_peak_bytes"), o.get("gpu_peak_bytes")),
                          # Same model, seed and data: the chunked loss and the offload must not change the first
                          # step's loss; later steps start from bf16 weights updated with gradients summed in
                          # another order.
                          "loss_first_abs_diff": abs(ms["losses"][0] - o["losses"][0]),
                          "loss_max_abs_diff": max(abs(a - b) for a, b in zip(ms["losses"], o["losses"]))}
        per_length[str(seq)] = row
    cap = results["dram_cap"]
    longest = ({c: longest_under_cap(runs, c, lengths) for c in names} if cap.get("enforced") else {})
    results["summary"] = {"memstrata_over": per_length, "longest_under_cap": longest,
                          "ratio": "memstrata / contender: tokens/s (>1: memstrata faster); CPU seconds per step, peak "
                                   "RSS and GPU peak (<1: memstrata uses less)"}
    return results
