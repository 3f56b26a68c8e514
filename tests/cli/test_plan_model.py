"""`memstrata plan --model DIR`: the plan of a manifest for another model directory, its shape read from the
directory's config.json, as `memstrata run --model` would train it; and a CPU job's working set named as such."""
from __future__ import annotations

from pathlib import Path
from typing import Any

TINY = "examples/finetune-tiny.yaml"


def test_plan_takes_a_model_directory(cli: Any, smollm2_dir: Path) -> None:
    proc = cli("plan", TINY, "--model", str(smollm2_dir))
    # The tiny example's 8Mi budget cannot hold a 135M model: the plan is printed, and says so (exit 2).
    assert proc.returncode == 2 and "verdict: does not fit" in proc.stdout, proc.stdout + proc.stderr
    assert "parameters: 134,515,008" in proc.stdout  # SmolLM2-135M's, not gpt-tiny's 527,872
    assert "CPU working set" in proc.stdout and "GPU working set" not in proc.stdout  # resources.gpus: 0


def test_plan_refuses_a_model_directory_that_is_not_one(cli: Any, tmp_path: Path) -> None:
    proc = cli("plan", TINY, "--model", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert str(tmp_path / "nothing") in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
