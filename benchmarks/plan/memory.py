"""Measured host memory of a training run against what the planner said, per small preset.

Run:
    python benchmarks/plan/memory.py                       # gpt-tiny and gpt-125m, 2 steps each
    python benchmarks/plan/memory.py --presets gpt-tiny --json out.json

For each preset: the plan for this machine (no GPU, so the working set is in DRAM too), then a real
`memstrata run` of that job with its report, and a child process that only imports what a run imports
(torch, DeepSpeed, transformers, memstrata's runtime) and opens the process group - the baseline no
plan counts. The planned figure is every byte the plan puts in DRAM; the measured one is the run's
peak RSS minus that baseline. The ratio measured/planned is printed and written as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BASELINE = """
import os, resource
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Port 0: the kernel picks one free when the store binds (another run may hold any fixed port).
for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
             ("MASTER_PORT", "0")):
    os.environ.setdefault(k, v)
import torch, deepspeed, transformers  # noqa: E401
import memstrata.runtime.train.recipe  # noqa: F401
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


# Budgets that send part of each model's state to the NVMe stratum, as a job that needs offloading has.
# (The least that fits: below it the embedding's own sub-group would have to stream through buffers of its size.)
DRAM_BUDGETS = {"gpt-tiny": "8Mi", "gpt-125m": "1000Mi", "gpt-350m": "1800Mi"}


def job(preset: str, steps: int, sequence_length: int, micro_batch: int) -> str:
    return f"""apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {{name: plan-memory-{preset}}}
spec:
  model: {{preset: {preset}}}
  dataset: {{synthetic: arithmetic}}
  training: {{sequenceLength: {sequence_length}, microBatch: {micro_batch}, steps: {steps}, precision: bf16}}
  resources: {{gpus: 0}}
  memory: {{dramBudget: {DRAM_BUDGETS[preset]}}}
"""


def measure(preset: str, steps: int, sequence_length: int, micro_batch: int, work: Path) -> dict[str, Any]:
    from memstrata.api import load_job
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job

    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    manifest = work / f"{preset}.yaml"
    manifest.write_text(job(preset, steps, sequence_length, micro_batch))
    scratch = work / f"{preset}-scratch"
    scratch.mkdir()
    plan = plan_job(load_job(manifest).spec, local_inventory(scratch))
    report = work / f"{preset}.json"
    proc = subprocess.run([sys.executable, "-m", "memstrata.cli", "run", str(manifest), "--nvme-path", str(scratch),
                           "--report-json", str(report)], capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{preset}: memstrata run failed:\n{proc.stderr[-3000:]}")
    base = subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True, env=env, check=True)
    baseline = int(base.stdout.strip().splitlines()[-1])
    peak = json.loads(report.read_text())["peak_rss_bytes"]
    planned = plan.bytes_on("dram")
    measured = peak - baseline
    return {"preset": preset, "parameters": plan.parameters, "planned_dram_bytes": planned,
            "peak_rss_bytes": peak, "baseline_rss_bytes": baseline, "measured_bytes": measured,
            "ratio": measured / planned if planned else None,
            "categories": {c.category: c.on("dram") for c in plan.categories}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="gpt-tiny,gpt-125m")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="plan-memory-") as tmp:
        rows = [measure(name, args.steps, args.sequence_length, args.micro_batch, Path(tmp))
                for name in args.presets.split(",")]
    mib = 1 << 20
    print(f"{'preset':<10} {'planned DRAM':>13} {'peak RSS':>10} {'baseline':>10} {'measured':>10} {'ratio':>6}")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        print(f"{r['preset']:<10} {r['planned_dram_bytes'] / mib:>9.1f} MiB {r['peak_rss_bytes'] / mib:>6.0f} MiB "
              f"{r['baseline_rss_bytes'] / mib:>6.0f} MiB {r['measured_bytes'] / mib:>6.0f} MiB {ratio:>6}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
