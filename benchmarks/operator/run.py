"""Operator latency under a burst, against a real control plane, with the Job controller as reference.

    python benchmarks/operator/run.py [--jobs 500] [--nodes 50] [--out benchmarks/results/operator.json]

One control plane, 50 kwok nodes with room for every job. Phase 1: 500 batch/v1 Jobs created at
once; kube-controller-manager's Job controller makes their pods. Phase 2: 500 FineTuneJobs created
at once; `memstrata operator` (a real subprocess) makes theirs. For each object the clock is the
client's monotonic clock: from the create response to the watch event of its pod's creation, and
(FineTuneJobs) to the first event with a non-empty status.phase. The operator's peak RSS is the
kernel's VmHWM of its process. Writes the JSON, a Markdown table beside it (.md) and a plot (.png, where
matplotlib imports: operator_plot.py).
"""
from __future__ import annotations

import argparse
import asyncio
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

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "operator"), str(REPO / "runtime"), str(REPO / "benchmarks"),
                str(Path(__file__).resolve().parent)]

from e2e.cluster.controlplane import ControlPlane, bin_dir_from_env  # noqa: E402
from e2e.operator.harness import (  # noqa: E402
    CRD, OperatorProcess, inventory, job, lease_holder, memstrata_node,
)
from memstrata.operator.kube import Conflict, Kube, api_path  # noqa: E402
from operator_plot import plot  # noqa: E402
from record import draw  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
TARGETS = {"p99_to_pod_created_s": 2.0, "ratio_vs_job_controller": 1.5, "operator_peak_rss_mb": 200.0}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


class Clock:
    """First-seen monotonic times per object, fed by watches."""

    def __init__(self) -> None:
        self.created: dict[str, float] = {}
        self.pod_seen: dict[str, float] = {}
        self.phase_seen: dict[str, float] = {}
        self.phase_events = 0
        self.watch_restarts = 0


class KubectlWatch:
    """`kubectl get --watch` in its own process, timestamped by a reader thread: a Go client keeps
    up with a burst where a Python asyncio client, busy creating, falls behind (and the API server
    then drops its watch), which would inflate exactly what is measured."""

    def __init__(self, cp: ControlPlane, args: list[str], on_line: Any) -> None:
        self.cmd = [str(cp.bin_dir / "kubectl"), "--kubeconfig", str(cp.kubeconfig), "get", *args, "--watch"]
        self.stopped = False
        self.restarts = -1
        self.proc: subprocess.Popen[str] | None = None
        self.thread = threading.Thread(target=self._read, args=(on_line,), daemon=True)
        self.thread.start()

    def _read(self, on_line: Any) -> None:
        # The API server closes watches under a burst; kubectl then exits. Start it again at once:
        # its initial list re-reports what exists (first-seen times are kept), so only objects
        # created during the restart gap (milliseconds) get a late time.
        while not self.stopped:
            self.restarts += 1
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                         bufsize=1)
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                on_line(line.split(), time.monotonic())
            self.proc.wait()

    def stop(self) -> None:
        self.stopped = True
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()


def watch_pods(cp: ControlPlane, ns: str, clock: Clock) -> KubectlWatch:
    def seen(words: list[str], t: float) -> None:
        if len(words) == 2 and words[0] == "ADDED":
            clock.pod_seen.setdefault(words[1], t)

    return KubectlWatch(cp, ["pods", "-n", ns, "--output-watch-events", "-o",
                             'jsonpath={.type}{" "}{.object.metadata.ownerReferences[0].name}{"\\n"}'], seen)


def watch_phases(cp: ControlPlane, ns: str, clock: Clock) -> KubectlWatch:
    def seen(words: list[str], t: float) -> None:
        clock.phase_events += 1
        if len(words) == 2:
            clock.phase_seen.setdefault(words[0], t)

    return KubectlWatch(cp, ["finetunejobs", "-n", ns, "-o",
                             'jsonpath={.metadata.name}{" "}{.status.phase}{"\\n"}'], seen)


async def burst(kube: Kube, docs: list[dict[str, Any]], clock: Clock) -> None:
    async def create(doc: dict[str, Any]) -> None:
        path = doc["_path"]
        body = {k: v for k, v in doc.items() if k != "_path"}
        for attempt in range(5):
            try:
                await kube.request("POST", path, body)
                break
            except Conflict:
                return
            except Exception:  # noqa: BLE001 — a 429/timeout under load: try again, then give up loudly
                if attempt == 4:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))
        clock.created[body["metadata"]["name"]] = time.monotonic()

    await asyncio.gather(*(create(d) for d in docs))


async def run_phase(cp: ControlPlane, kube: Kube, ns: str, docs: list[dict[str, Any]], with_phase: bool,
                    timeout: float) -> tuple[Clock, float]:
    clock = Clock()
    watches = [watch_pods(cp, ns, clock)] + ([watch_phases(cp, ns, clock)] if with_phase else [])
    await asyncio.sleep(3)  # kubectl has opened its watches (the namespace is empty until the burst)
    began = time.monotonic()
    await burst(kube, docs, clock)
    names = [d["metadata"]["name"] for d in docs]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(n in clock.pod_seen for n in names) and (not with_phase or all(n in clock.phase_seen for n in names)):
            break
        await asyncio.sleep(0.2)
    for w in watches:
        w.stop()
    clock.watch_restarts = sum(w.restarts for w in watches)
    print(f"[{ns}] pods seen {len(clock.pod_seen)}, job events {clock.phase_events}, phases {len(clock.phase_seen)}, "
          f"watch restarts {clock.watch_restarts}", file=sys.stderr)
    return clock, time.monotonic() - began


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """utime+stime of each process, from /proc (clock ticks -> seconds)."""
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 1) for k in after}


def latencies(clock: Clock, seen: dict[str, float]) -> tuple[list[float], int]:
    out = [seen[n] - t for n, t in clock.created.items() if n in seen]
    return out, len(clock.created) - len(out)


def summary(values: list[float], missing: int) -> dict[str, Any]:
    """The statistics, and every object's latency (sorted) for the distribution the plot draws."""
    return {"p50_s": round(pct(values, 50), 3), "p99_s": round(pct(values, 99), 3),
            "max_s": round(max(values), 3) if values else float("nan"),
            "mean_s": round(statistics.fmean(values), 3) if values else float("nan"), "missing": missing,
            "samples_s": [round(v, 3) for v in sorted(values)]}


def batch_job(name: str) -> dict[str, Any]:
    return {"_path": "", "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "containers": [{"name": "main", "image": "busybox"}]}}}}


async def measure(cp: ControlPlane, jobs: int, nodes: int, workdir: Path) -> dict[str, Any]:
    crd = os.environ.get("MEMSTRATA_E2E_CRD", str(CRD))  # see e2e/operator/conftest.py
    cp.kubectl("apply", "--server-side", "-f", crd)
    cp.wait_established("finetunejobs.memstrata.dev")
    per_node = -(-jobs // nodes)
    cp.create(*[memstrata_node(f"bench-{i:03d}", inventory(f"bench-{i:03d}", dram_gib=64, gpus=per_node))
                for i in range(nodes)])
    cp.wait_for("bench nodes Ready", lambda: all(
        any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
        for n in cp.get_json("nodes")["items"]), timeout=120)
    for ns in ("bench-jobs", "bench-ftj"):
        cp.create_namespace(ns)

    op = OperatorProcess(cp.kubeconfig, workdir / "operator.log", "bench", "--workers", "64").start()
    kube = Kube.from_config(str(cp.kubeconfig), connections=128, timeout_s=120)
    try:
        for _ in range(240):  # the operator holds the Lease and has filled its indices
            if lease_holder(cp) == op.identity:
                break
            await asyncio.sleep(0.25)
        await asyncio.sleep(2)
        ref_docs = [batch_job(f"job-{i:04d}") for i in range(jobs)]
        for d in ref_docs:
            d["_path"] = api_path("batch/v1", "jobs", "bench-jobs")
        pids = {name: proc.pid for name, proc in cp._procs.items()}  # noqa: SLF001 — diagnostics only
        pids["memstrata-operator"] = op.pid
        cpu0 = cpu_seconds(pids)
        ref_clock, ref_wall = await run_phase(cp, kube, "bench-jobs", ref_docs, with_phase=False, timeout=300)
        cpu1 = cpu_seconds(pids)

        docs = []
        for i in range(jobs):
            d = job(f"ftj-{i:04d}")
            d["_path"] = api_path("memstrata.dev/v1alpha1", "finetunejobs", "bench-ftj")
            docs.append(d)
        rss_before = op.peak_rss_bytes()
        cpu2 = cpu_seconds(pids)
        clock, wall = await run_phase(cp, kube, "bench-ftj", docs, with_phase=True, timeout=300)
        rss = op.peak_rss_bytes()
        cpu3 = cpu_seconds(pids)
    finally:
        await kube.close()
        op.stop()

    to_pod, miss_pod = latencies(clock, clock.pod_seen)
    to_phase, miss_phase = latencies(clock, clock.phase_seen)
    ref, miss_ref = latencies(ref_clock, ref_clock.pod_seen)
    p99, ref_p99 = pct(to_pod, 99), pct(ref, 99)
    return {
        "benchmark": "operator", "jobs": jobs, "nodes": nodes,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "control_plane_startup_s": round(cp.startup_seconds, 1),
        "memstrata": {"to_pod_created": summary(to_pod, miss_pod), "to_first_phase": summary(to_phase, miss_phase),
                      "burst_wall_s": round(wall, 2), "cpu_seconds": cpu_delta(cpu2, cpu3),
                      "watch_restarts": clock.watch_restarts},
        "job_controller": {"to_pod_created": summary(ref, miss_ref), "burst_wall_s": round(ref_wall, 2),
                           "cpu_seconds": cpu_delta(cpu0, cpu1), "watch_restarts": ref_clock.watch_restarts},
        "p50_to_pod_created_s": round(pct(to_pod, 50), 3),
        "p99_to_pod_created_s": round(p99, 3),
        "p50_to_first_phase_s": round(pct(to_phase, 50), 3),
        "p99_to_first_phase_s": round(pct(to_phase, 99), 3),
        "job_controller_p99_to_pod_created_s": round(ref_p99, 3),
        "ratio_vs_job_controller": round(p99 / ref_p99, 3) if ref_p99 else None,
        "operator_peak_rss_mb": round(rss / 2**20, 1),
        "operator_rss_before_burst_mb": round(rss_before / 2**20, 1),
        "targets": TARGETS,
        "notes": "kube-controller-manager runs with its default client rate limit (--kube-api-qps 20, burst 30); "
                 "the operator has no client-side rate limit.",
    }


def table(r: dict[str, Any], png: str | None = None) -> str:
    m, j = r["memstrata"], r["job_controller"]
    rows = [
        ("create -> pod created, p50 (s)", m["to_pod_created"]["p50_s"], j["to_pod_created"]["p50_s"]),
        ("create -> pod created, p99 (s)", m["to_pod_created"]["p99_s"], j["to_pod_created"]["p99_s"]),
        ("create -> first status.phase, p50 (s)", m["to_first_phase"]["p50_s"], "-"),
        ("create -> first status.phase, p99 (s)", m["to_first_phase"]["p99_s"], "-"),
        ("burst wall time (s)", m["burst_wall_s"], j["burst_wall_s"]),
        ("controller peak RSS (MB)", r["operator_peak_rss_mb"], "-"),
    ]
    lines = [f"![create-to-pod latency: memstrata operator vs Job controller]({png})", ""] if png else []
    lines += [f"{r['jobs']} objects at once, {r['nodes']} kwok nodes",
              "| metric | memstrata operator | Job controller |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines.append(f"p99 ratio memstrata / Job controller: {r['ratio_vs_job_controller']} (target <= 1.5); "
                 f"p99 target < 2 s; RSS target < 200 MB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=500)
    p.add_argument("--nodes", type=int, default=50)
    p.add_argument("--out", type=Path, default=RESULTS / "operator.json")
    args = p.parse_args(argv)
    bin_dir, reason = bin_dir_from_env()
    if bin_dir is None:
        print(f"benchmarks/operator: cannot run: {reason}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="memstrata-bench-operator-"))
    with ControlPlane(bin_dir) as cp:
        result = asyncio.run(measure(cp, args.jobs, args.nodes, workdir))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    text = table(result, png.name)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(draw(plot, result, png) or f"written: {png}")
    print(f"written: {args.out} (operator log: {workdir / 'operator.log'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
