"""Helpers shared by the swap-layer tests (a uniquely named module: every test dir has a conftest)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "benchmarks" / "offload" / "harness.py"


def harness_cmd(engine: str, out: Path, swap_dir: Path, *, steps: int, preset: str = "gpt-tiny",
                nvme: list[str] | None = None, swap: dict[str, Any] | None = None, extra: list[str] | None = None
                ) -> list[str]:
    cmd = [sys.executable, str(HARNESS), "--engine", engine, "--preset", preset, "--steps", str(steps),
           "--swap-dir", str(swap_dir), "--out", str(out)]
    if nvme:
        cmd += ["--nvme", ",".join(nvme)]
    if swap:
        cmd += ["--swap-json", json.dumps(swap)]
    return cmd + (extra or [])


def run_harness(engine: str, tmp: Path, *, steps: int, timeout: float = 900, **kw: Any) -> dict[str, Any]:
    out = tmp / f"{engine}.json"
    swap_dir = tmp / f"{engine}-swap"
    cmd = harness_cmd(engine, out, swap_dir, steps=steps, **kw)
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"{engine} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["swap_dir"] = str(swap_dir)
    return result


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def resume_attempt(job: Path, tmp: Path, losses: Path, kill: str | None = None) -> subprocess.CompletedProcess[str]:
    """One attempt of `job` through resume_worker.py (resuming when a checkpoint is there), its step losses
    appended to `losses`; `kill`: `phase:step:marker`, where the worker SIGKILLs itself."""
    args = [sys.executable, str(Path(__file__).resolve().parent / "resume_worker.py"), str(job), str(tmp / "nvme"),
            str(losses)]
    if kill is not None:
        args += ["--kill", kill]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONHASHSEED": "0"}
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
