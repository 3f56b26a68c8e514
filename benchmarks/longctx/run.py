"""Long-context fine-tuning: throughput and peak memory versus sequence length, memstrata (activation
checkpoints in its host pool, chunked loss) against stock ZeRO-3 with and without CPU activation checkpointing.

    python benchmarks/longctx/run.py                 # CPU: SmolLM2-135M-Instruct at 1K, 2K, 4K under a 6.5 GiB cap
    python benchmarks/longctx/run.py --quick         # 512 and 1K under a 4.5 GiB cap: a few minutes
    python benchmarks/longctx/run.py --gpu           # a GPU node: the llama3.2-1b preset at 4K to 32K

Each (length, contender) is one `memstrata run`-equivalent training (benchmarks/longctx/worker.py) in its own
process tree (benchmarks/record.run_watched), run as root inside its own cgroup memory group capped at --dram-cap
(benchmarks/offload/memcap.py). Its peak RSS is the worker's own high-water mark (VmHWM): the tree sampler also
records one, which now and then counts a vfork'd child (DeepSpeed's CPU accelerator runs `numactl --hardware`
during training) as a second copy of the trainer. CPU seconds per step are beside tokens/s because the machine
may be shared: they move far less with other load than wall time does. A run the OOM killer ends under the cap is
run again without it, so every length still has a throughput and a peak for every contender; at longer lengths
that contender is not tried under the cap again. The contenders and the ratios: benchmarks/longctx/sweep.py.
Writes benchmarks/results/<--name>.json, .md and .png (default longctx; --quick: longctx-quick; --gpu: longctx-gpu;
the plot: longctx_plot.py, where matplotlib imports).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "offload"), str(REPO / "runtime"),
                str(REPO / "operator")]

import sweep  # noqa: E402
from longctx_plot import plot  # noqa: E402
from memcap import DramCap  # noqa: E402
from record import machine, run_watched, write_results  # noqa: E402
from sweep_md import markdown  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
WORKER = HERE / "worker.py"
MODELS = Path.home() / ".cache" / "memstrata" / "models"
CPU_LENGTHS, QUICK_LENGTHS, GPU_LENGTHS = "1024,2048,4096", "512,1024", "4096,8192,16384,32768"
CPU_CAP, QUICK_CAP, GPU_PRESET = "6.5Gi", "4.5Gi", "llama3.2-1b"


def smollm2_dir() -> Path | None:
    """The SmolLM2-135M-Instruct directory `make model` converts (MEMSTRATA_SMOLLM2_DIR, or the newest cached)."""
    named = os.environ.get("MEMSTRATA_SMOLLM2_DIR")
    found = [Path(named)] if named else sorted(MODELS.glob("smollm2-135m-instruct-*"), key=lambda p: p.stat().st_mtime)
    return next((p for p in reversed(found) if (p / ".complete").exists()), None)


def cap_bytes(text: str) -> int:
    """--dram-cap: a quantity (6Gi, 6GiB, 6442450944); 0 or none for no cap."""
    from memstrata.api.units import parse_bytes

    text = text.strip()
    if text.lower() in ("0", "none", ""):
        return 0
    return parse_bytes(text.removesuffix("B") if text.endswith("iB") else text)


def numa_layout() -> dict[str, Any]:
    """This host's NUMA nodes and the nodes memstrata-cxl would interleave over (none: it is skipped)."""
    from memstrata.node.local import numa_and_cxl_nodes

    numa, cxl = numa_and_cxl_nodes()
    return {"nodes": [{"id": n.id, "kind": n.kind, "cpus": len(n.cpus), "memory_bytes": n.memory_bytes} for n in numa],
            "cxl_nodes": sweep.cxl_candidates(numa, cxl)}


class Runner:
    """Runs one contender at one length (capped or not) and returns its record."""

    def __init__(self, args: argparse.Namespace, cap: int, cxl_nodes: list[int], scratch: Path) -> None:
        self.args, self.cap, self.cxl_nodes, self.scratch = args, cap, cxl_nodes, scratch

    def command(self, c: sweep.Contender, seq: int, work: Path) -> list[str]:
        import yaml

        a = self.args
        job = work / "job.yaml"
        job.write_text(yaml.safe_dump(sweep.manifest(c, seq=seq, steps=a.steps, loss_chunk=a.loss_chunk,
                                                     model_path=a.model, preset=a.preset, gpus=int(a.gpu))))
        cmd = [sys.executable, str(WORKER), "--job", str(job), "--nvme-path", str(work / "nvme"),
               "--out", str(work / "result.json"), "--checkpointing", c.checkpointing]
        if c.activations == "cxl":
            cmd += ["--cxl-nodes", ",".join(map(str, self.cxl_nodes))]
        return cmd + (["--gpu"] if a.gpu else [])

    def run(self, c: sweep.Contender, seq: int, capped: bool) -> dict[str, Any]:
        work = Path(tempfile.mkdtemp(prefix=f"longctx-{c.name}-{seq}-", dir=self.scratch))
        rec: dict[str, Any] = {"contender": c.name, "seq": seq, "capped": False, "ok": False,
                               "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
        dram, why = DramCap.open(f"longctx-{c.name}", self.cap) if capped else (None, "run without the cap")
        print(f"== {c.name} seq {seq} " + (f"under {self.cap / 2**30:.2f} GiB" if dram else f"({why})"), flush=True)
        try:
            cmd = self.command(c, seq, work)
            try:
                w = run_watched(cmd, REPO, self.args.timeout, preexec=dram.preexec if dram else None)
                rec.update(capped=dram is not None, wall_seconds=round(w.wall_seconds, 1),
                           tree_peak_rss_bytes=w.tree_peak_rss_bytes, oom_killed=bool(dram and dram.oom_killed()),
                           cgroup_peak_bytes=dram.peak_bytes() if dram else None)
            finally:
                if dram:
                    dram.close()
            out = work / "result.json"
            data = json.loads(out.read_text()) if out.exists() else {}
            rec["command"] = " ".join(cmd)
            if w.returncode == 0 and data.get("rc") == 0:
                rec.update(measure(data), ok=True)
            else:
                rec["error"] = ("killed by the OOM killer under the cap" if rec["oom_killed"]
                                else data.get("error") or w.error())
            return rec
        finally:
            shutil.rmtree(work, ignore_errors=True)
            print(json.dumps({k: rec.get(k) for k in ("contender", "seq", "capped", "ok", "error", "tokens_per_second",
                                                      "peak_rss_bytes", "tree_peak_rss_bytes", "cgroup_peak_bytes",
                                                      "oom_killed")}), flush=True)


def measure(data: dict[str, Any]) -> dict[str, Any]:
    """What a finished worker's result says: steady tokens/s and CPU seconds, every step's, the losses, its peak
    RSS (the kernel's high-water mark), the run report's peaks and phases, memstrata's activation pool, the GPU
    peak."""
    report = data.get("report") or {}
    ms = report.get("memstrata") or {}
    steps = data["steps"]
    return {"tokens_per_second": sweep.steady(steps), "cpu_seconds_per_step": sweep.steady(steps, "cpu_seconds"),
            "step_tokens_per_second": [s["tokens_per_second"] for s in steps],
            "step_cpu_seconds": [s.get("cpu_seconds") for s in steps], "losses": [s["loss"] for s in steps],
            "peak_rss_bytes": data["max_rss_bytes"], "report_peak_rss_bytes": report.get("peak_rss_bytes"),
            "load_peak_rss_bytes": report.get("load_peak_rss_bytes"), "phases": report.get("phases"),
            "offload": report.get("offload"), "activations": ms.get("activations"),
            "gpu_peak_bytes": data.get("gpu_peak_bytes"), "plan_dram_bytes": data.get("plan_dram_bytes"),
            "plan_hbm_bytes": data.get("plan_hbm_bytes")}


def sweep_lengths(results: dict[str, Any], runner: Runner, contenders: list[sweep.Contender], save: Any) -> None:
    """Every length, shortest first, every contender: under the cap until the cap kills it once (then without
    it); a run that fails for any other reason (a bug, a GPU out of memory) is not tried at longer lengths."""
    failed_at: dict[str, int] = {}
    broken: dict[str, str] = {}
    enforced, rerun = results["dram_cap"]["enforced"], results["rerun_uncapped"]
    for seq in results["lengths"]:
        for c in contenders:
            skip = broken.get(c.name) or (f"not tried under the cap: OOM there at {failed_at[c.name]}"
                                          if c.name in failed_at else None)
            if skip:
                results["runs"].append({"contender": c.name, "seq": seq, "capped": c.name not in broken, "ok": False,
                                        "skipped": True, "error": skip})
            if c.name in broken or (c.name in failed_at and not rerun):
                continue
            rec = runner.run(c, seq, capped=enforced and c.name not in failed_at)
            results["runs"].append(rec)
            if rec["capped"] and rec["oom_killed"]:
                failed_at[c.name] = seq
                if rerun:
                    rec = runner.run(c, seq, capped=False)
                    results["runs"].append(rec)
            if not rec["ok"] and not rec["oom_killed"]:
                why = (rec.get("error") or "").strip().splitlines()[-1:] or ["?"]
                broken[c.name] = f"not tried: failed at {seq}: {why[0][:200]}"
            save()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, 2 steps, a {QUICK_CAP} cap")
    ap.add_argument("--gpu", action="store_true", help=f"train on cuda:0; default lengths {GPU_LENGTHS}, the "
                                                       f"{GPU_PRESET} preset, no DRAM cap")
    ap.add_argument("--lengths", help=f"comma-separated sequence lengths (default {CPU_LENGTHS})")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per run; the first is not measured")
    ap.add_argument("--dram-cap", help=f"cgroup memory cap per run, e.g. 6Gi; 0 for none (default {CPU_CAP} "
                                       "on the CPU, none with --gpu)")
    ap.add_argument("--no-rerun", action="store_true", help="do not rerun without the cap what the cap OOM-killed")
    ap.add_argument("--contenders", default=",".join(c.name for c in sweep.CONTENDERS))
    ap.add_argument("--model", help="a Hugging Face model directory (default: SmolLM2-135M-Instruct from make model)")
    ap.add_argument("--preset", help="a memstrata.api.architecture preset with random weights instead of --model")
    ap.add_argument("--loss-chunk", type=int, default=1024, help="memstrata's lossChunkTokens")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--scratch", default="/var/tmp/memstrata-bench-longctx", help="work directories (a disk)")
    ap.add_argument("--name", help="results file name under benchmarks/results/ (default longctx[-gpu])")
    ap.add_argument("--from-json", type=Path, help="re-summarise an earlier run's records, running nothing")
    args = ap.parse_args(argv)
    args.lengths = [int(n) for n in (args.lengths or (GPU_LENGTHS if args.gpu else
                                                       QUICK_LENGTHS if args.quick else CPU_LENGTHS)).split(",")]
    if args.quick:
        args.steps = 2
    if args.dram_cap is None:
        args.dram_cap = "0" if args.gpu else QUICK_CAP if args.quick else CPU_CAP
    if args.model and args.preset:
        ap.error("give --model or --preset, not both")
    if not args.model and not args.preset and not args.from_json:
        found = GPU_PRESET if args.gpu else smollm2_dir()
        if found is None:
            ap.error("no SmolLM2-135M-Instruct directory: run `make model`, or pass --model DIR or --preset NAME")
        args.preset, args.model = (found, None) if args.gpu else (None, str(found))
    args.name = args.name or ("longctx-gpu" if args.gpu else "longctx-quick" if args.quick else "longctx")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.from_json:
        old = sweep.summarize(json.loads(args.from_json.read_text()))
        write_results(old, RESULTS, old.get("name", args.name), markdown, started - old.get("total_seconds", 0.0),
                      plot=plot)
        return 0
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--gpu: torch sees no CUDA device here")
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    cap = cap_bytes(args.dram_cap)
    probe, why = DramCap.open("longctx-probe", cap) if cap else (None, "no cap asked (--dram-cap 0)")
    if probe is not None:
        probe.close()
    numa = numa_layout()
    wanted = [sweep.BY_NAME[n] for n in args.contenders.split(",")]
    skipped = {}
    if not numa["cxl_nodes"] and "memstrata-cxl" in args.contenders.split(","):
        skipped["memstrata-cxl"] = ("skipped: no CXL or other CPU-less NUMA node on this host (NUMA nodes: "
                                    + ", ".join(f"{n['id']} ({n['kind']}, {n['cpus']} CPUs)" for n in numa["nodes"])
                                    + ")")
    results: dict[str, Any] = {
        "benchmark": "longctx", "name": args.name, "machine": machine(scratch), "device": "cuda" if args.gpu else "cpu",
        "model": args.model or f"preset {args.preset}", "lengths": args.lengths, "steps": args.steps,
        "micro_batch": 1, "precision": "bf16", "loss_chunk_tokens": args.loss_chunk,
        "contenders": [c.name for c in wanted], "what": {c.name: c.what for c in wanted},
        "skipped_contenders": skipped, "numa": numa, "rerun_uncapped": not args.no_rerun,
        "dram_cap": ({"enforced": True, "bytes": cap, "mechanism": probe.mechanism} if probe is not None
                     else {"enforced": False, "bytes": cap, "why_not": why}),
        "statistic": f"tokens/s and CPU s/step (the worker's user + system time): median over steps 2..{args.steps} "
                     "(step 1 is warm-up); peak RSS: the worker's own high-water mark (getrusage ru_maxrss, the "
                     "kernel's VmHWM); cgroup peak: the most its memory group was charged (RSS and page cache)",
        "loadavg_start": [round(x, 2) for x in os.getloadavg()], "runs": []}

    def save() -> None:  # after every run, so a later failure or timeout keeps what was measured; quietly
        with contextlib.redirect_stdout(io.StringIO()):
            write_results(sweep.summarize(results), RESULTS, args.name, markdown, started, plot=plot)

    runner = Runner(args, cap, numa["cxl_nodes"], scratch)
    sweep_lengths(results, runner, [c for c in wanted if c.name not in skipped], save)
    write_results(sweep.summarize(results), RESULTS, args.name, markdown, started, plot=plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
