"""What a benchmark ran on, for its report: CPU, cores, kernel, DRAM, and the scratch directory's filesystem."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
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
