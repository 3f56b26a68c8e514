"""memstrata vs stock ZeRO-Infinity (default settings and tuned settings), one run each, same model/seed/batch.

    python benchmarks/offload/run.py --models gpt-125m,gpt-350m --seq 1024 --steps 3

Every contender runs benchmarks/offload/harness.py in its own process tree,
in a cgroup v1 memory group with the same cap (memcap.py), while this script
samples the tree's summed RSS (+ /dev/shm) and VmLck every 50 ms (these
machines have no cgroup memory.peak; the group's max_usage_in_bytes is
recorded beside it). Stock swaps to files on a disk filesystem (checked with
statfs); memstrata to a loop device with direct I/O over a file on the same
disk. First, stock with DeepSpeed's literal defaults and memstrata run a model
those defaults cannot hold. Writes benchmarks/results/offload.json and
offload.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from memcap import DramCap

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "benchmarks" / "offload" / "harness.py"
RESULTS = REPO / "benchmarks" / "results"
TMPFS_MAGIC = 0x01021994


def tree_pids(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def shm_bytes() -> int:
    return sum(p.stat().st_size for p in Path("/dev/shm").glob("*") if p.is_file())


class Sampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_rss, self.peak_locked, self.stop = pid, 0, 0, False
        self.shm0 = shm_bytes()

    def run(self) -> None:
        while not self.stop:
            pids = tree_pids(self.pid)
            rss = sum(status_kb(p, "VmRSS:") for p in pids) * 1024 + max(0, shm_bytes() - self.shm0)
            locked = sum(status_kb(p, "VmLck:") for p in pids) * 1024
            self.peak_rss, self.peak_locked = max(self.peak_rss, rss), max(self.peak_locked, locked)
            time.sleep(0.05)


def run_one(name: str, cmd: list[str], out: Path, timeout: float, cap_bytes: int = 0) -> dict[str, Any]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{REPO / 'runtime'}:{REPO / 'operator'}:"
           + os.environ.get("PYTHONPATH", "")}
    cap, why = DramCap.open(name, cap_bytes) if cap_bytes else (None, "no cap asked for")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=cap.preexec if cap else None)
        sampler = Sampler(proc.pid)
        sampler.start()
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err = f"timed out after {timeout} s\n" + err
        sampler.stop = True
        sampler.join()
        capped = {"dram_cap_bytes": cap.limit_bytes, "cgroup_peak_bytes": cap.peak_bytes(),
                  "oom_killed": cap.oom_killed()} if cap else {"dram_cap_bytes": None, "dram_cap_missing": why}
        if capped.get("oom_killed"):  # the last line is what the table shows
            err = f"{err}\nkilled by the OOM killer under the {cap_bytes / (1 << 30):.1f} GiB DRAM cap"
    finally:
        if cap:
            cap.close()
    res: dict[str, Any] = {"contender": name, "command": " ".join(cmd), "wall_seconds": time.perf_counter() - t0,
                           "peak_rss_bytes": sampler.peak_rss, "peak_locked_bytes": sampler.peak_locked, **capped,
                           "ok": proc.returncode == 0 and out.exists(),
                           "loadavg_before": [round(x, 2) for x in load_before],
                           "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    if res["ok"]:
        data = json.loads(out.read_text())
        ph = data["phases"]
        later = slice(1, None) if len(data["losses"]) > 1 else slice(0, None)  # step 1 includes warm-up
        mean = statistics.median  # a shared machine: the median resists a step slowed by a neighbour
        res.update(init_seconds=data["init_seconds"], time_to_first_step=data["time_to_first_step"],
                   step_seconds=mean(data["step_seconds"][later]), forward_seconds=mean(ph["forward"][later]),
                   backward_seconds=mean(ph["backward"][later]), update_seconds=mean(ph["update"][later]),
                   step_seconds_all=data["step_seconds"], losses=data["losses"], params=data["params"],
                   rss_peak_by_phase=data.get("rss_peak_by_phase"), swap=data.get("swap"), config=data.get("config"))
    else:
        tail = [ln for ln in err.splitlines() if ln.strip()][-6:]
        res["error"] = "\n".join(tail)
    return res


# Llama-shaped, 2 layers, Llama-3's vocabulary: the 131M-element embedding is larger than the 1e8-element
# buffers stock DeepSpeed pins for offload_param by default.
FAILURE_ARCH = {"family": "llama", "layers": 2, "hidden": 1024, "intermediate": 2816, "heads": 16, "kv_heads": 8,
                "vocab": 128256, "tied": True}


# memstrata's defaults, and the one setting that trades peak memory for update time.
MEMSTRATA_VARIANTS: dict[str, dict[str, Any]] = {"memstrata": {}, "memstrata-keep-pool": {"trim_after_step": False}}


def contender_cmd(contender: str, work: Path, out: Path, args: list[str]) -> tuple[list[str], str | None]:
    """The harness command for one contender; memstrata gets a fresh loop device (returned, to detach)."""
    cmd = [sys.executable, str(HARNESS), *args, "--swap-dir", str(work / "swap"), "--out", str(out)]
    if contender.startswith("stock-"):
        return cmd + ["--engine", "stock", "--profile", contender.removeprefix("stock-")], None
    if contender not in MEMSTRATA_VARIANTS:
        raise SystemExit(f"unknown contender {contender!r}: memstrata variants {sorted(MEMSTRATA_VARIANTS)} or "
                         "stock-literal|stock-default|stock-tuned")
    if MEMSTRATA_VARIANTS[contender]:
        cmd += ["--swap-json", json.dumps(MEMSTRATA_VARIANTS[contender])]
    img = work / "ns0.img"
    with open(img, "wb") as f:
        f.truncate(16 << 30)
    loop = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", str(img)], check=True,
                          capture_output=True, text=True).stdout.strip()
    return cmd + ["--engine", "memstrata", "--nvme", loop], loop


def run_contender(scratch: Path, label: str, contender: str, args: list[str], timeout: float,
                  cap_bytes: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"{label}-{contender}-", dir=scratch))
    out = work / "result.json"
    loop = None
    try:
        cmd, loop = contender_cmd(contender, work, out, args)
        print(f"== {label} {contender}", flush=True)
        res = run_one(contender, cmd, out, timeout, cap_bytes)
        res["swap_dir_bytes"] = dir_bytes(work / "swap")
    finally:
        if loop:
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        subprocess.run(["rm", "-rf", str(work)])
    print(json.dumps({k: v for k, v in res.items() if k not in ("losses", "swap", "command", "config")}), flush=True)
    return res


def failure_demo(scratch: Path, timeout: float, cap_bytes: int) -> dict[str, Any]:
    """Stock with DeepSpeed's literal defaults vs memstrata, 2 steps of a model stock cannot hold."""
    args = ["--arch-json", json.dumps(FAILURE_ARCH), "--steps", "2", "--seq", "256", "--batch", "1"]
    runs = [run_contender(scratch, "llama-vocab", c, args, timeout, cap_bytes) for c in ("stock-literal", "memstrata")]
    return {"architecture": FAILURE_ARCH, "steps": 2, "seq": 256,
            "runs": [{k: r.get(k) for k in ("contender", "ok", "error", "losses", "peak_rss_bytes")} for r in runs]}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt-125m,gpt-350m")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--contenders", default="memstrata,memstrata-keep-pool,stock-default,stock-tuned")
    ap.add_argument("--scratch", default="/var/tmp/memstrata-bench-offload", help="on a disk filesystem")
    ap.add_argument("--dram-cap-gib", type=float, default=16.0,
                    help="the same cgroup memory cap for every contender (0: none)")
    ap.add_argument("--no-failure-demo", dest="failure_demo", action="store_false",
                    help="skip the run of stock's literal defaults on a model they cannot hold")
    ap.add_argument("--name", default="offload", help="results file name under benchmarks/results/")
    ap.add_argument("--from-json", type=Path, help="rebuild offload.json/.md from an earlier run's records, "
                                                   "running nothing")
    args = ap.parse_args()
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        results["models"] = {m: summarize(v["runs"]) for m, v in results["models"].items()}
        _write(results)
        return 0
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    cap_bytes = int(args.dram_cap_gib * (1 << 30))
    if os.statvfs(scratch).f_bsize and _fs_magic(scratch) == TMPFS_MAGIC:
        raise SystemExit(f"{scratch} is on tmpfs: stock would swap to DRAM; pick a disk filesystem")
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                                           "python": platform.python_version(), "scratch": str(scratch),
                                           "scratch_fs_magic": hex(_fs_magic(scratch))},
                               "name": args.name, "seq": args.seq, "batch": args.batch, "steps": args.steps,
                               "dram_cap": dram_cap_record(cap_bytes),
                               "statistic": "median over steps 2..N (step 1 includes warm-up)",
                               "loadavg_start": [round(x, 2) for x in os.getloadavg()],
                               "models": {}}
    if args.failure_demo:
        results["stock_failures"] = failure_demo(scratch, args.timeout, cap_bytes)
        _write(results)
    for model in args.models.split(","):
        runs = []
        for contender in args.contenders.split(","):
            harness_args = ["--preset", model, "--steps", str(args.steps), "--seq", str(args.seq),
                            "--batch", str(args.batch)]
            runs.append(run_contender(scratch, model, contender, harness_args, args.timeout, cap_bytes))
        results["models"][model] = summarize(runs)
        results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        _write(results)  # after every model, so a later failure or timeout keeps what was measured
    return 0


def _write(results: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = results.get("name", "offload")
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=1))
    (RESULTS / f"{name}.md").write_text(markdown(results))


def dram_cap_record(cap_bytes: int) -> dict[str, Any]:
    """What the JSON says about the cap; whether each run really was capped is in its own record."""
    probe, why = DramCap.open("probe", cap_bytes) if cap_bytes else (None, "--dram-cap-gib 0")
    if probe:
        probe.close()
    return {"enforced": probe is not None, "bytes": cap_bytes or None, "machine_dram_bytes": _mem_total(),
            "mechanism": "a cgroup v1 memory group per contender (memory.limit_in_bytes); cgroup_peak_bytes is its "
                         "memory.max_usage_in_bytes (RSS + page cache charged to it)",
            **({} if probe else {"why_not": why})}


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _fs_magic(path: Path) -> int:
    import ctypes

    class Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 120)]

    buf = Statfs()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(str(path).encode(), ctypes.byref(buf)) != 0:
        raise OSError(ctypes.get_errno(), f"statfs {path}")
    return buf.f_type & 0xFFFFFFFF


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ours = next((r for r in runs if r["contender"] == "memstrata" and r["ok"]), None)
    stock = [r for r in runs if r["contender"].startswith("stock") and r["ok"]]
    out: dict[str, Any] = {"runs": runs}
    if ours and stock:
        best = min(stock, key=lambda r: r["step_seconds"])
        out["best_stock"] = best["contender"]
        out.update(_ratios(ours, best))
        # Best by step time is the headline; the ratios against every stock profile say the rest (the
        # fastest stock profile and the leanest one are not the same).
        out["ratios_by_stock"] = {r["contender"]: _ratios(ours, r) for r in stock}
    return out


def _ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    return {key: round(ours[field] / theirs[field], 3) if theirs[field] else None
            for key, field in (("peak_rss_ratio", "peak_rss_bytes"), ("step_time_ratio", "step_seconds"),
                               ("update_time_ratio", "update_seconds"), ("init_time_ratio", "init_seconds"))}


def _gib(nbytes: int | None) -> str:
    return f"{nbytes / (1 << 30):.2f}" if nbytes else ""


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# Offload: memstrata vs stock ZeRO-Infinity (seq {results['seq']}, batch {results['batch']}, "
             f"{results['steps']} steps, CPU, {results['machine']['cpus']} cores)", "",
             "| model | contender | ok | init s | 1st step s | step s | fwd | bwd | update | peak RSS GiB | "
             "cgroup peak GiB | peak locked GiB | NVMe written GiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    g = 1 << 30
    for model, m in results["models"].items():
        for r in m["runs"]:
            if not r["ok"]:
                lines.append(f"| {model} | {r['contender']} | FAILED: {r['error'].splitlines()[-1][:80]} "
                             f"| | | | | | | {r['peak_rss_bytes'] / g:.2f} | {_gib(r.get('cgroup_peak_bytes'))} | "
                             f"{r['peak_locked_bytes'] / g:.2f} | |")
                continue
            nv = (r.get("swap") or {}).get("nvme", {}).get("bytesWritten")
            written = nv / g if nv is not None else r.get("swap_dir_bytes", 0) / g
            lines.append(f"| {model} | {r['contender']} | yes | {r['init_seconds']:.1f} | "
                         f"{r['time_to_first_step']:.1f} | {r['step_seconds']:.2f} | {r['forward_seconds']:.2f} | "
                         f"{r['backward_seconds']:.2f} | {r['update_seconds']:.2f} | {r['peak_rss_bytes'] / g:.2f} | "
                         f"{_gib(r.get('cgroup_peak_bytes'))} | {r['peak_locked_bytes'] / g:.2f} | {written:.2f} |")
        for name, r in (m.get("ratios_by_stock") or {}).items():
            best = " (best by step time)" if name == m["best_stock"] else ""
            lines.append(f"| {model} | **memstrata / {name}**{best} | | init {r['init_time_ratio']} | | "
                         f"step {r['step_time_ratio']} | | | update {r['update_time_ratio']} | "
                         f"RSS {r['peak_rss_ratio']} | | | |")
    lines += ["", "Peak RSS of the training process per phase, GiB (which phase sets the peak):", "",
              "| model | contender | init | forward | backward | update |", "|---|---|---|---|---|---|"]
    for model, m in results["models"].items():
        for r in m["runs"]:
            ph = r.get("rss_peak_by_phase") or {}
            lines.append(f"| {model} | {r['contender']} | " + " | ".join(
                f"{ph[k] / g:.2f}" if k in ph else "" for k in ("init", "forward", "backward", "update")) + " |")
    fail = results.get("stock_failures")
    if fail:
        lines += ["", f"A model stock's literal defaults cannot hold ({json.dumps(fail['architecture'])}, "
                  f"{fail['steps']} steps, seq {fail['seq']}):", ""]
        for r in fail["runs"]:
            what = (f"ran, losses {[round(x, 3) for x in r['losses']]}" if r["ok"]
                    else f"failed: `{(r.get('error') or '').splitlines()[-1][:160]}`")
            lines.append(f"- {r['contender']}: {what}")
    cap = results["dram_cap"]
    cap_text = (f"{cap['bytes'] / g:.1f} GiB per contender, enforced by a cgroup v1 memory group"
                if cap["enforced"] else f"none enforced ({cap.get('why_not')})")
    lines += ["", f"DRAM cap: {cap_text} (machine {cap['machine_dram_bytes'] / g:.1f} GiB). "
              "Step/phase times are medians over steps 2..N. "
              f"Load average at start {results['loadavg_start']}, end {results.get('loadavg_end')} (shared machine).",
              "Targets: peak_rss_ratio <= 0.40, step_time_ratio <= 0.70 (update <= 0.50), init_time_ratio <= 0.10.",
              "Stock 'NVMe written' is the size of its swap folder at the end (files), memstrata's the device counter."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
