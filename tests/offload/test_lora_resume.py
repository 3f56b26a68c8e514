"""A LoRA run resumes like a full one: killed in a forward pass and resumed from its checkpoint, it trains the
steps an uninterrupted run trains, bit for bit (the adapters' fp32 master weights and moments, the RNG that
their dropout draws from, the data position all come back; the frozen base is rebuilt from its source). A
checkpoint of one method never resumes a run of the other: what trains, and so the optimizer state, differs.

Each attempt is its own process (tests/offload/resume_worker.py), as a pod's retry is."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml
from offload_helpers import resume_attempt

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("deepspeed_ready")]
pytest.importorskip("peft", reason="peft is not installed: run `make install`")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STEPS = 6


def job_file(tmp: Path, checkpoints: Path, method: str) -> Path:
    doc = yaml.safe_load((REPO / "examples" / "finetune-tiny.yaml").read_text())
    doc["metadata"]["name"] = "resume-lora"
    training = doc["spec"]["training"]
    training.update(steps=STEPS, method=method)
    if method == "lora":
        training["lora"] = {"rank": 4, "targetModules": ["c_attn", "c_fc"], "dropout": 0.1}
    doc["spec"]["checkpoint"] = {"path": str(checkpoints), "everySteps": 2, "keep": 3}
    path = tmp / f"{method}-{checkpoints.name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def step_losses(losses: Path) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for line in losses.read_text().splitlines():
        r = json.loads(line)
        if "step" in r:
            out.setdefault(r["step"], set()).add(r["loss"])
    return out


def test_a_killed_lora_run_resumes_bit_for_bit_and_never_from_a_full_runs_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "nvme").mkdir()
    straight = tmp_path / "straight.jsonl"
    done = resume_attempt(job_file(tmp_path, tmp_path / "ck-straight", "lora"), tmp_path, straight)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = step_losses(straight)
    assert sorted(expected) == list(range(1, STEPS + 1))

    checkpoints, losses, marker = tmp_path / "ck", tmp_path / "losses.jsonl", tmp_path / "marker"
    job = job_file(tmp_path, checkpoints, "lora")
    killed = resume_attempt(job, tmp_path, losses, f"forward:4:{marker}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert marker.read_text().split() == ["forward", "4"]
    final = resume_attempt(job, tmp_path, losses)
    assert final.returncode == 0, final.stderr[-3000:]
    assert step_losses(losses) == expected, "the resumed LoRA run's losses differ from the uninterrupted run's"

    # The same job as a full fine-tune finds the LoRA checkpoints and refuses them, naming the field.
    refused = resume_attempt(job_file(tmp_path, checkpoints, "full"), tmp_path, tmp_path / "full.jsonl")
    assert refused.returncode != 0
    assert "training.method: the checkpoint has 'lora', this job 'full'" in refused.stderr, refused.stderr[-3000:]
