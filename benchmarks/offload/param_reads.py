"""Parameters moved once per step: NVMe bytes read for the weights per step with gradient accumulation, memstrata
layer-major vs memstrata one micro-batch at a time vs stock ZeRO-Infinity (run as root: loop devices, mount).

    python benchmarks/offload/param_reads.py --models gpt-125m,gpt-350m --accumulation 4

Every contender trains the same model, data and loss (the chunked loss, memstrata.runtime.train.model.loss) with
`--accumulation` micro-batches of `--batch` a step, the weights on NVMe and the optimizer state in DRAM
(offload_param nvme, offload_optimizer cpu), so every byte read from the scratch device is a weight:
- memstrata-layer-major: memstrata's engine, the step's micro-batches through each layer together
  (memstrata.runtime.train.model.layermajor; the runtime's choice where weights are on NVMe);
- memstrata-micro-batches: memstrata's engine, one micro-batch after the other (layerMajor: false);
- stock: DeepSpeed ZeRO-Infinity, its tuned profile (the one memstrata.plan.stock configures).
memstrata reads a raw loop device (its namespace); stock reads its swap files on an ext4 loop device of its own, so
/proc/diskstats of each device counts that contender's reads alone. Per contender: bytes read per step (median
over the measured steps), how many times that reads the weights (2 B x parameters in bf16), memstrata's own
'param' counter beside it, the median step time and the losses. Ratios: stock's and memstrata-micro-batches'
reads over layer-major's; step times likewise. Writes benchmarks/results/<--name>.json, .md and .png.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "runtime"), str(HERE.parents[1] / "operator")]

from budget import spread, step_io  # noqa: E402
from contenders import HARNESS, attach_loop  # noqa: E402
from record import machine, pyplot, run_watched, save_figure, write_results  # noqa: E402

RESULTS = HERE.parents[1] / "benchmarks" / "results"
LAYER_MAJOR, MICRO, STOCK = "memstrata-layer-major", "memstrata-micro-batches", "stock"
CONTENDERS = (LAYER_MAJOR, MICRO, STOCK)


def _mounted_loop(work: Path) -> tuple[str, Path]:
    """A fresh ext4 loop device mounted under `work`: stock's swap files on a device of their own."""
    loop = attach_loop(work)
    mnt = work / "mnt"
    mnt.mkdir()
    subprocess.run(["mkfs.ext4", "-q", "-F", loop], check=True, capture_output=True)
    subprocess.run(["mount", loop, str(mnt)], check=True, capture_output=True)
    return loop, mnt


def run_one(contender: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"{model}-{contender}-", dir=args.scratch))
    out, loop, mnt = work / "result.json", None, None
    rec: dict[str, Any] = {"contender": contender, "ok": False}
    try:
        cmd = [sys.executable, str(HARNESS), "--preset", model, "--seq", str(args.seq), "--batch", str(args.batch),
               "--accumulation", str(args.accumulation), "--steps", str(args.warmup + args.measured), "--zero-init",
               "--checkpointing", "--precision", "bf16", "--param-device", "nvme", "--optim-device", "cpu",
               "--out", str(out)]
        if contender == STOCK:
            loop, mnt = _mounted_loop(work)
            cmd += ["--engine", "stock", "--profile", "tuned", "--swap-dir", str(mnt / "swap")]
        else:
            loop = attach_loop(work)
            cmd += ["--engine", "memstrata", "--swap-dir", str(work / "swap"), "--nvme", loop,
                    *(["--layer-major"] if contender == LAYER_MAJOR else [])]
        device = Path(loop).name
        cmd += ["--diskstats", device]
        print(f"== {model} {contender}", flush=True)
        w = run_watched(cmd, HERE.parents[1], args.timeout)
        rec.update(command=" ".join(cmd), wall_seconds=round(w.wall_seconds, 2), peak_rss_bytes=w.tree_peak_rss_bytes)
        if w.returncode != 0 or not out.exists():
            rec["error"] = w.error()
            return rec
        rec.update(measure(json.loads(out.read_text()), args.warmup, device))
        rec["ok"] = True
        return rec
    finally:
        if mnt is not None:
            subprocess.run(["umount", str(mnt)], capture_output=True)
        if loop:
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({k: rec.get(k) for k in ("contender", "ok", "error", "read_bytes_per_step",
                                                  "weight_reads_per_step")}), flush=True)


def measure(data: dict[str, Any], warmup: int, device: str) -> dict[str, Any]:
    """A finished harness's record: per-step reads of the device and of memstrata's 'param' counter, steps."""
    io = step_io((data.get("diskstats") or {}).get("steps", []), device, warmup) or {}
    kinds = data.get("nvme_by_kind")
    marks = [data.get("nvme_by_kind_init") or {}, *kinds] if kinds else []
    counted = sorted(b.get("param", [0, 0])[1] - a.get("param", [0, 0])[1] for a, b in zip(marks, marks[1:]))[warmup:]
    weight_bytes = 2 * data["params"]  # bf16
    read = io.get("read_bytes")
    return {"read_bytes_per_step": read, "weight_bytes": weight_bytes,
            "weight_reads_per_step": round(read / weight_bytes, 2) if read is not None else None,
            "param_counter_bytes_per_step": counted[len(counted) // 2] if counted else None,
            "step": spread(data["step_seconds"][warmup:]), "losses": data["losses"],
            "layer_major": data.get("layer_major"), "accumulation": data.get("accumulation")}


def losses_differ(a: list[float], b: list[float], rel: float = 1e-3) -> int | None:
    """The first step (1-based) whose losses differ by more than `rel`, or None: the same training."""
    return next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if abs(x - y) > rel * max(abs(x), abs(y))), None)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    for m in results["models"].values():
        runs = {r["contender"]: r for r in m["runs"] if r.get("ok")}
        lm = runs.get(LAYER_MAJOR)
        for r in runs.values():
            r["losses_differ_from_step"] = losses_differ(r["losses"], lm["losses"]) if lm else None
        for name in (MICRO, STOCK):
            other = runs.get(name)
            if lm and other and lm["read_bytes_per_step"] and other["read_bytes_per_step"] is not None:
                m[f"reads_{name}_over_layer_major"] = round(other["read_bytes_per_step"] / lm["read_bytes_per_step"], 2)
                m[f"step_{name}_over_layer_major"] = round(other["step"]["median"] / lm["step"]["median"], 3)
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = ["# Weights read per step with gradient accumulation: layer-major vs one micro-batch at a time", "",
             f"![weights read per step]({results.get('name', 'offload-param-reads')}.png)", "",
             f"seq {results['seq']}, micro-batch {results['batch']}, {results['accumulation']} micro-batches a step, "
             f"bf16, weights on NVMe, optimizer state in DRAM; {results['machine']['cores']} cores; median of "
             f"{results['measured']} steps after {results['warmup']}", "",
             "| model | contender | read per step | x the weights | memstrata 'param' counter | step s | "
             "reads / layer-major | step / layer-major | losses vs layer-major |", "|---|---|---|---|---|---|---|---|---|"]
    for name, m in results["models"].items():
        for r in m["runs"]:
            if not r.get("ok"):
                lines.append(f"| {name} | {r['contender']} | failed: {(r.get('error') or '').splitlines()[-1:]} "
                             "| | | | | | |")
                continue
            counter = r.get("param_counter_bytes_per_step")
            ratio = m.get(f"reads_{r['contender']}_over_layer_major", "")
            step_ratio = m.get(f"step_{r['contender']}_over_layer_major", "")
            lines.append(f"| {name} | {r['contender']} | {r['read_bytes_per_step'] / 2**20:.1f} MiB | "
                         f"{r['weight_reads_per_step']} | {'' if counter is None else f'{counter / 2**20:.1f} MiB'} | "
                         f"{r['step']['median']:.2f} | {ratio} | {step_ratio} | {_same(r)} |")
    return "\n".join(lines) + "\n"


def _same(run: dict[str, Any]) -> str:
    step = run.get("losses_differ_from_step")
    return "same (1e-3)" if step is None else f"differ from step {step}"


def plot(results: dict[str, Any], path: Path) -> str | None:
    plt = pyplot()
    if isinstance(plt, str):
        return plt
    models = results["models"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(CONTENDERS)
    for i, contender in enumerate(CONTENDERS):
        xs = [j + i * width for j in range(len(models))]
        runs = [next((r for r in m["runs"] if r["contender"] == contender and r.get("ok")), None)
                for m in models.values()]
        axes[0].bar(xs, [r["weight_reads_per_step"] if r else 0 for r in runs], width, label=contender)
        axes[1].bar(xs, [r["step"]["median"] if r else 0 for r in runs], width, label=contender)
    for ax, title in zip(axes, ("weights read per step (x the model's bf16 bytes)", "median step time (s)")):
        ax.set_xticks([j + width for j in range(len(models))], list(models))
        ax.set_title(title)
    axes[0].legend()
    save_figure(fig, path)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt-125m")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--accumulation", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--measured", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--scratch", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--name", default="offload-param-reads")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    results: dict[str, Any] = {"name": args.name, "seq": args.seq, "batch": args.batch,
                               "accumulation": args.accumulation, "warmup": args.warmup, "measured": args.measured,
                               "machine": machine(args.scratch), "command": " ".join(sys.argv), "models": {}}
    for model in args.models.split(","):
        results["models"][model] = {"runs": [run_one(c, model, args) for c in CONTENDERS]}
    write_results(summarize(results), RESULTS, args.name, markdown, started, plot=plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
