"""I/O benchmark: memstrata's raw-NVMe engine vs DeepSpeed's aio handle vs fio.

Run (root: it creates and detaches its own loop device):
    python benchmarks/io/run.py [--gib 1] [--runs 5] [--dir /var/tmp/memstrata-bench]

One backing file on the machine's disk, written once in full, under a loop
device with direct I/O on: memstrata and fio use that loop device. DeepSpeed's
handle cannot read raw block devices (it aborts the process), so it gets a
second fully written file on the same disk. Same block size, queue depth and
offsets (sequential from 1 MiB, where memstrata's data area starts) for all;
write and read; 1 and 4 MiB blocks; queue depth 8 and 32; the median of
--runs runs with the contenders' order rotated every run. Writes
benchmarks/results/io.json and io.md (with the load average before and after every run:
the machine is shared). The pinned-memory half of io.json is benchmarks/io/pinned.py.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "runtime"), str(REPO / "operator")]

from memstrata.runtime import _native  # noqa: E402
from memstrata.node.header import DATA_OFFSET  # noqa: E402
from memstrata.runtime.strata.nvme import NvmeEngine  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO / "benchmarks")]
from report import render  # noqa: E402

MiB = 1 << 20
CASES = [(op, bs, qd) for op in ("write", "read") for bs in (1 * MiB, 4 * MiB) for qd in (8, 32)]


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def fio_command(dev: str, op: str, bs: int, qd: int, total: int) -> list[str]:
    return ["fio", "--name=ceiling", f"--filename={dev}", "--ioengine=io_uring", "--direct=1", "--fixedbufs",
            f"--rw={op}", f"--bs={bs}", f"--iodepth={qd}", f"--offset={DATA_OFFSET}", f"--size={total}",
            "--numjobs=1", "--output-format=json"]


def run_fio(dev: str, op: str, bs: int, qd: int, total: int) -> float:
    out = json.loads(sh(*fio_command(dev, op, bs, qd, total)))
    return out["jobs"][0][op]["bw_bytes"] / 2**30


class Memstrata:
    """The engine on one backend, named, never chosen for it: `io_uring` (its fast path, with fixed
    buffers) or `threads` (the pread/pwrite path it falls back to where seccomp refuses io_uring)."""

    def __init__(self, dev: str, total: int, backend: str = "io_uring") -> None:
        self.dev, self.total, self.backend = dev, total, backend
        self.buf = _native.Region(total)
        memoryview(self.buf)[:] = os.urandom(MiB) * (total // MiB)

    def run(self, op: str, bs: int, qd: int) -> float:
        with NvmeEngine.open([self.dev], job="bench/io", queue_depth=qd, max_io_bytes=bs, stripe_bytes=bs,
                             io_backend=self.backend) as eng:
            assert eng.io_backend == self.backend, eng.io_backend
            eng.register_buffers([self.buf])  # like fio --fixedbufs
            ext = eng.allocate(self.total)
            assert ext.bases == (DATA_OFFSET,)
            t0 = time.perf_counter()
            eng.wait(eng.write(ext, self.buf) if op == "write" else eng.read(ext, self.buf))
            dt = time.perf_counter() - t0
            st = eng.stats()[0]
            assert st.errors == 0
            assert self.backend != "io_uring" or st.fixed_buffer_ios == self.total // bs
        return self.total / dt / 2**30


def aio_handle_args(bs: int, qd: int) -> tuple[int, int, bool, bool, int]:
    # (block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism):
    # DeepSpeed's own ZeRO-3 NVMe defaults except block size and depth, which match the case.
    return (bs, qd, False, True, 1)


class DeepSpeedAio:
    def __init__(self, path: str, total: int) -> None:
        import torch
        from deepspeed.ops.op_builder import AsyncIOBuilder

        self.module = AsyncIOBuilder().load(verbose=False)
        self.path, self.total, self.torch = path, total, torch
        probe = self.module.aio_handle(MiB, 8, False, True, 1)
        self.buf = probe.new_cpu_locked_tensor(total, torch.empty(0, dtype=torch.uint8))
        self.buf.copy_(torch.randint(0, 255, (total,), dtype=torch.uint8))

    def run(self, op: str, bs: int, qd: int) -> float:
        h = self.module.aio_handle(*aio_handle_args(bs, qd))
        call = h.async_pwrite if op == "write" else h.async_pread
        t0 = time.perf_counter()
        call(self.buf, self.path, DATA_OFFSET)
        if h.wait() != 1:
            raise RuntimeError(f"DeepSpeed aio {op} did not complete")
        dt = time.perf_counter() - t0
        return self.total / dt / 2**30


def machine(backing: Path) -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    src = sh("findmnt", "-n", "-o", "SOURCE,FSTYPE", "--target", str(backing)).split()
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "backing_filesystem": {"source": src[0], "fstype": src[1] if len(src) > 1 else "?"},
            "liburing": "2.3 (Debian)", "fio": sh("fio", "--version").strip(), "python": platform.python_version(),
            "deepspeed": deepspeed_version()}


def deepspeed_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("deepspeed")
    except Exception:
        return None


def loadavg() -> list[float]:
    # The machine is shared; the load next to each run says how much the numbers can be trusted.
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0, help="bytes moved per run")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp/memstrata-bench")
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args()
    total = int(args.gib * 2**30) // (4 * MiB) * (4 * MiB)
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    size = total + 4 * MiB  # header + data area, a whole number of dd blocks
    images = [work / "loop-backing.img", work / "deepspeed.img"]
    for img in images:  # written once in full so no run pays for block allocation
        if not img.exists() or img.stat().st_size != size:
            sh("dd", "if=/dev/zero", f"of={img}", "bs=4M", f"count={size // (4 * MiB)}", "oflag=direct")
    dev = sh("losetup", "-f", "--show", "--direct-io=on", str(images[0])).strip()
    try:
        contenders: dict[str, Callable[[str, int, int], float]] = {
            "memstrata": Memstrata(dev, total).run, "memstrata-threads": Memstrata(dev, total, "threads").run,
            "fio": lambda op, bs, qd: run_fio(dev, op, bs, qd, total)}
        ds_note = None
        if not args.no_deepspeed:
            try:
                contenders["deepspeed"] = DeepSpeedAio(str(images[1]), total).run
            except Exception as exc:  # reported in the results, never silently dropped
                ds_note = f"DeepSpeed aio unavailable: {type(exc).__name__}: {exc}"
                print(ds_note, file=sys.stderr)
        samples: dict[tuple[str, int, int], dict[str, list[float]]] = {c: {k: [] for k in contenders} for c in CASES}
        names = list(contenders)
        loads = [loadavg()]
        for r in range(args.runs):
            for case in CASES:
                for name in names[r % len(names):] + names[: r % len(names)]:
                    samples[case][name].append(contenders[name](*case))
            loads.append(loadavg())
            print(f"run {r + 1}/{args.runs} done, load {loads[-1]}", file=sys.stderr)
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)
    results = []
    for (op, bs, qd), by in samples.items():
        med = {k: statistics.median(v) for k, v in by.items()}
        row = {"op": op, "block_bytes": bs, "queue_depth": qd, "gib_per_s": med,
               "samples_gib_per_s": by, "ratio_vs_fio": med["memstrata"] / med["fio"],
               "threads_ratio_vs_fio": med["memstrata-threads"] / med["fio"],
               "ratio_vs_deepspeed": med["memstrata"] / med["deepspeed"] if "deepspeed" in med else None,
               "fio_command": " ".join(fio_command("<loopdev>", op, bs, qd, total)),
               "deepspeed_call": (f"aio_handle{aio_handle_args(bs, qd)}.async_p{op}(new_cpu_locked_tensor"
                                  f"({total}), <file on same disk>, {DATA_OFFSET}); wait()")}
        results.append(row)
    res_dir = REPO / "benchmarks" / "results"
    res_dir.mkdir(parents=True, exist_ok=True)
    prev = json.loads((res_dir / "io.json").read_text()) if (res_dir / "io.json").exists() else {}
    out = {"benchmark": "io", "bytes_per_run": total, "runs": args.runs, "machine": machine(images[0]),
           "load_average_1_5_15_before_and_after_each_run": loads, "contender_order": "rotated every run",
           "deepspeed_note": ds_note, "target": "ratio_vs_fio >= 0.95 in every case", "cases": results}
    if "pinned" in prev:  # written by benchmarks/io/pinned.py; kept across reruns of this one
        out["pinned"] = prev["pinned"]
    (res_dir / "io.json").write_text(json.dumps(out, indent=2) + "\n")
    print(render(res_dir))


if __name__ == "__main__":
    if os.geteuid() != 0 or shutil.which("fio") is None:
        sys.exit("benchmarks/io needs root (loop device) and fio")
    main()
