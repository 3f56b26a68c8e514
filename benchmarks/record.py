"""What every benchmark records: the machine it ran on, and its results written as JSON, Markdown and a plot."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

# Draws results as a PNG at a path: None when written, else why it drew nothing.
Plot = Callable[[dict[str, Any], Path], str | None]


def machine(scratch: Path) -> dict[str, Any]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(scratch)], capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "dram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "scratch": str(scratch), "scratch_fs": fs}


def pyplot() -> ModuleType | str:
    """matplotlib.pyplot drawing to files (the Agg backend, no display needed), or why not ("no plot: ...")
    where matplotlib does not import: it is no dependency of the benchmarks."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: {exc}"
    return plt


def save_figure(fig: Any, path: Path, rect: tuple[float, float, float, float] | None = None) -> None:
    """Lay `fig` out (within `rect`, leaving room for a tall title), write it to `path` as every benchmark's
    PNGs are written, and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=rect) if rect is not None else fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(plot: Plot, results: dict[str, Any], path: Path) -> str | None:
    """`plot(results, path)`; a plot that fails says why instead of ending the benchmark that measured them."""
    try:
        return plot(results, path)
    except Exception as exc:  # noqa: BLE001 — the JSON and the table are written already; the plot is extra
        return f"no plot: {type(exc).__name__}: {exc}"


def write_results(results: dict[str, Any], directory: Path, name: str, render: Callable[[dict[str, Any]], str],
                  started: float, *, plot: Plot | None = None) -> None:
    """Close `results` (load average, total time), write `<name>.json` and `<name>.md` under `directory`, print
    the table; with `plot`, draw `<name>.png` beside them (or print why it did not)."""
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["total_seconds"] = time.perf_counter() - started
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    table = render(results)
    (directory / f"{name}.md").write_text(table)
    print(table, end="")
    print(f"wrote {directory / (name + '.json')} and .md in {results['total_seconds'] / 60:.1f} min")
    if plot is not None:
        png = directory / f"{name}.png"
        print(draw(plot, results, png) or f"wrote {png}")


@dataclass(frozen=True)
class Watched:
    """One benchmark process, run to its end: its exit status, stderr, wall time and its tree's peak RSS."""

    returncode: int
    err: str
    wall_seconds: float
    tree_peak_rss_bytes: int

    def error(self) -> str:
        """The last lines of what it said that are not DeepSpeed's warnings (or its exit status)."""
        tail = [ln for ln in self.err.splitlines() if ln.strip() and "WARNING" not in ln][-15:]
        return "\n".join(tail) or f"exit status {self.returncode}"


def run_watched(cmd: list[str], repo: Path, timeout: float, preexec: Callable[[], None] | None = None) -> Watched:
    """Run `cmd` on the CPU from `repo` with its sources on the path, the RSS of its whole process tree sampled
    every 20 ms from outside; past `timeout` it is asked to stop (a torch elastic agent passes SIGTERM on to its
    workers), then killed. `preexec` runs in the child before exec (e.g. joining a capped cgroup)."""
    from memstrata.runtime.train.observe.memwatch import MemWatch

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONHASHSEED": "0",
           "PYTHONPATH": f"{repo / 'runtime'}:{repo / 'operator'}:" + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec)
    watch = MemWatch(None, interval=0.02, root_pid=proc.pid).start()
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        err = f"timed out after {timeout:.0f} s\n{err}"
    watch.stop()
    return Watched(proc.returncode, err, time.perf_counter() - t0, watch.peak_rss)
