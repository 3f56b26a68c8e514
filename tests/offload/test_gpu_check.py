"""benchmarks/gpu/check.py, the one command that checks a GPU machine, run here on the CPU with its tiny profile:
every item runs (or says why it cannot), memstrata and stock train the same model on the same data, the exported
model reloads with the engine's validation loss, and the table, the JSON and the plot are written. Its plumbing is
proven before a GPU ever sees it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "benchmarks" / "gpu" / "check.py"

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("deepspeed_ready")]


def _check(out: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(CHECK), "--cpu", "--out", str(out), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_gpu_check_runs_every_item_on_the_cpu(tmp_path: Path) -> None:
    proc = _check(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu-check-cpu.json").read_text())
    items = results["items"]
    assert list(items)[:3] == ["gpu-tests", "memstrata-8Mi", "stock-8Mi"]  # most important first
    assert items["gpu-tests"]["status"] == "passed" and "skipped" in items["gpu-tests"]["summary"]
    for name, r in items.items():
        assert r["status"] in ("completed", "passed", "refused by the planner", "skipped"), (name, r)
    # Side by side means the same job: the same losses, step for step, whatever the engine.
    for budget in ("8Mi", "64Mi", "8Mi-accum4"):
        assert items[f"memstrata-{budget}"]["losses"] == pytest.approx(items[f"stock-{budget}"]["losses"], rel=1e-3)
    assert items["stock-4Mi"]["status"] == "refused by the planner"  # where only memstrata's plan fits
    # Asked for by name, the delayed update ran: each update beside the next forward and backward.
    update = items["memstrata-8Mi-delayed"]["update"]
    assert update["on"] and update["mode"] == "delayed" and update["updates"] >= 2, update
    assert items["memstrata-4Mi"]["tokens_per_second"] > 0 and items["memstrata-4Mi"]["plan_dram_bytes"] > 0
    assert items["memstrata-long"]["activations"]["livePeakBytes"] > 0  # the checkpoints went through the pool
    assert items["memstrata-export"]["reloaded_validation_loss"] == pytest.approx(
        items["memstrata-export"]["engine_validation_loss"], rel=1e-2)
    lora = items["memstrata-lora"]["losses"]
    assert lora[-1] < lora[0]
    table = (tmp_path / "gpu-check-cpu.md").read_text()
    assert all(f"| {name} |" in table for name in items) and "not judged on the CPU" in table
    assert (tmp_path / "gpu-check-cpu.png").stat().st_size > 0


def test_items_the_budget_leaves_no_time_for_are_recorded_not_run(tmp_path: Path) -> None:
    proc = _check(tmp_path, "--only", "runs", "--items", "memstrata-8Mi,stock-8Mi", "--budget-seconds", "1",
                  timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    items = json.loads((tmp_path / "gpu-check-cpu.json").read_text())["items"]
    assert [(n, r["status"]) for n, r in items.items()] == [("memstrata-8Mi", "not run"), ("stock-8Mi", "not run")]
