"""What every benchmark records: the machine it ran on, and its results written as JSON and Markdown."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
import json
import time
from collections.abc import Callable
from typing import Any


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


def write_results(results: dict[str, Any], directory: Path, name: str, render: Callable[[dict[str, Any]], str],
                  started: float) -> None:
    """Close `results` (load average, total time), write `<name>.json` and `<name>.md` under `directory`, print
    the table."""
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["total_seconds"] = time.perf_counter() - started
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    table = render(results)
    (directory / f"{name}.md").write_text(table)
    print(table, end="")
    print(f"wrote {directory / (name + '.json')} and .md in {results['total_seconds'] / 60:.1f} min")
