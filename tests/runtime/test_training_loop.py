"""The training loop a user configures: warmup and cosine decay, AdamW's weight decay, per-step metrics.

Real `memstrata run` of gpt-tiny, a few steps each (one DeepSpeed per process): the learning rate in
metrics.jsonl is the schedule's, step by step, on both engines; TensorBoard reads back the same losses;
weight decay really shrinks the trained weights.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from memstrata.api.finetunejob import LearningRateSchedule
from memstrata.runtime.train.schedule import lr_multiplier

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("status_worker.py")
STEPS, LR = 6, 3e-3
SCHEDULE = {"type": "cosine", "warmupSteps": 2, "minLearningRateRatio": 0.1}

pytestmark = pytest.mark.slow


def _dataset(path: Path) -> Path:
    rng = random.Random(5)
    with path.open("w") as f:
        for _ in range(300):
            a, b = rng.randrange(1000), rng.randrange(1000)
            f.write(json.dumps({"text": f"{a}+{b}={a + b}"}) + "\n")
    return path


def _run(tmp: Path, name: str, *, engine: str, weight_decay: float, statuses: bool = False) -> dict[str, Any]:
    """One fine-tune through `memstrata run` or, with `statuses`, through run_local as the pod drives it
    (every RuntimeReport it would patch into the job's status recorded): its report, its metrics directory,
    its saved model's path."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: run `make install`")
    work = tmp / name
    (work / "nvme").mkdir(parents=True)
    memory: dict[str, Any] = {"engine": engine}
    if engine == "memstrata":
        memory["dramBudget"] = "8Mi"  # the optimizer state and weights really go through memstrata's NVMe engine
    doc = {
        "apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": name},
        "spec": {
            "model": {"preset": "gpt-tiny"},
            "dataset": {"path": str(_dataset(work / "data.jsonl")), "validationSplit": 0.1},
            "training": {"sequenceLength": 64, "microBatch": 4, "steps": STEPS, "learningRate": LR,
                         "precision": "bf16", "evalInterval": 3, "schedule": SCHEDULE,
                         "optimizer": {"weightDecay": weight_decay}},
            "output": {"path": str(work / "model")},
            "resources": {"gpus": 0},
            "memory": memory,
        },
    }
    (work / "job.yaml").write_text(yaml.safe_dump(doc))
    job, nvme, report = str(work / "job.yaml"), str(work / "nvme"), str(work / "report.json")
    command = ([str(WORKER), job, nvme, report, str(work / "status.jsonl")] if statuses else
               ["-m", "memstrata.cli", "run", job, "--nvme-path", nvme, "--report-json", report])
    proc = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = work / "status.jsonl"
    return {"report": json.loads((work / "report.json").read_text()), "metrics": work / "model-metrics",
            "model": work / "model", "stdout": proc.stdout, "stderr": proc.stderr,
            "statuses": [json.loads(line) for line in status.read_text().splitlines()] if statuses else []}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("loop")
    return {"plain": _run(tmp, "plain", engine="deepspeed", weight_decay=0.0, statuses=True),
            "decayed": _run(tmp, "decayed", engine="deepspeed", weight_decay=10.0),
            "memstrata": _run(tmp, "swapped", engine="memstrata", weight_decay=0.0)}


def _metrics(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run["metrics"] / "metrics.jsonl").read_text().splitlines()]


def _expected_rates() -> list[float]:
    schedule = LearningRateSchedule.model_validate(SCHEDULE)
    # Step k is taken with the rate after k-1 updates: 0 first (warmup), the peak at step 3, then cosine.
    return [LR * lr_multiplier(k - 1, schedule, STEPS) for k in range(1, STEPS + 1)]


@pytest.mark.parametrize("name", ["plain", "memstrata"])
def test_each_step_runs_at_the_schedules_rate(runs: dict[str, dict[str, Any]], name: str) -> None:
    steps = [m for m in _metrics(runs[name]) if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert [m["learning_rate"] for m in steps] == pytest.approx(_expected_rates(), rel=1e-6)
    assert steps[0]["learning_rate"] == 0.0 and steps[2]["learning_rate"] == pytest.approx(LR)
    assert runs[name]["report"]["learning_rates"] == pytest.approx(_expected_rates(), rel=1e-6)
    assert all(m["grad_norm"] > 0 and m["tokens"] == 4 * 64 and m["tokens_per_second"] > 0 for m in steps)


def test_metrics_carry_validation_and_tensorboard_reads_the_same_losses(runs: dict[str, dict[str, Any]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = runs["plain"]
    lines = _metrics(run)
    validation = {m["step"]: m["validation_loss"] for m in lines if "validation_loss" in m}
    assert sorted(validation) == [0, 3, 6]  # before training, every evalInterval, at the end
    assert validation == pytest.approx({int(k): v for k, v in run["report"]["validation_losses"].items()})
    acc = EventAccumulator(str(run["metrics"]))
    acc.Reload()
    losses = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert losses == pytest.approx({m["step"]: m["loss"] for m in lines if "loss" in m}, rel=1e-6)
    assert {e.step: e.value for e in acc.Scalars("validation/loss")} == pytest.approx(validation, rel=1e-6)
    rates = [e.value for e in acc.Scalars("train/learning_rate")]
    assert rates == pytest.approx(_expected_rates(), rel=1e-5, abs=1e-12)
    # The printed report and progress lines show the rate too.
    assert "cosine to 0.1x, 2 warmup steps" in run["stdout"] and "lr 3.00e-03" in run["stderr"]


def test_weight_decay_shrinks_the_trained_weights(runs: dict[str, dict[str, Any]]) -> None:
    from safetensors.torch import load_file

    def norm(model: Path, matrices: bool) -> float:
        tensors: dict[str, Any] = {}
        for f in sorted(model.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        return float(sum(t.float().pow(2).sum() for t in tensors.values() if (t.dim() >= 2) == matrices) ** 0.5)

    plain, decayed = norm(runs["plain"]["model"], True), norm(runs["decayed"]["model"], True)
    # AdamW takes lr x 10 of each weight off per update: about 9% over this schedule, far beyond bf16 noise.
    assert decayed < 0.95 * plain, (plain, decayed)
    # Biases and norm scales are not decayed (transformers' Trainer's grouping): no such shrinkage there.
    flat_plain, flat_decayed = norm(runs["plain"]["model"], False), norm(runs["decayed"]["model"], False)
    assert flat_decayed > 0.98 * flat_plain, (flat_plain, flat_decayed)
    assert _metrics(runs["decayed"])[-1]["loss"] != _metrics(runs["plain"])[-1]["loss"]


def test_the_jobs_status_carries_the_rate_the_latest_validation_and_the_result(
        runs: dict[str, dict[str, Any]]) -> None:
    run = runs["plain"]
    lines = {m["step"]: m for m in _metrics(run)}
    # One report per step (the one after them says the model was saved).
    training = [r for r in run["statuses"] if r["stage"] == "training" and r["output"] is None]
    assert [r["step"] for r in training] == list(range(1, STEPS + 1))
    assert [r["learningRate"] for r in training] == pytest.approx(_expected_rates(), rel=1e-6)
    # Every report points to the metrics: what status.progress.metricsPath shows `kubectl get ftj -o yaml` users.
    assert {r["metricsPath"] for r in run["statuses"]} == {str(run["metrics"])}
    from memstrata.api.report import RuntimeReport

    progress = RuntimeReport.model_validate(training[-1]).status_patch()["status"]["progress"]
    assert progress["metricsPath"] == str(run["metrics"])
    # The validation loss shown is the latest measured: step 0's until step 3 measures again, then step 6's.
    shown = [r["validationLoss"] for r in training]
    assert shown == pytest.approx([lines[0]["validation_loss"]] * 2 + [lines[3]["validation_loss"]] * 3
                                  + [lines[6]["validation_loss"]])
    final = run["statuses"][-1]
    assert final["stage"] == "finished"
    assert final["result"] == pytest.approx({"steps": STEPS, "trainLoss": lines[STEPS]["loss"],
                                             "validationLoss": lines[STEPS]["validation_loss"]})


def _scalars(acc: Any, prefix: str) -> dict[str, dict[int, float]]:
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"] if tag.startswith(prefix)}


@pytest.mark.parametrize("name", ["plain", "memstrata"])
def test_tensorboard_shows_each_steps_strata_io_phases_and_the_plan(runs: dict[str, dict[str, Any]], name: str) -> None:
    """Read back with TensorBoard's own reader: per step, what DRAM and NVMe hold, the bytes moved each way and
    their bandwidth, the forward/backward/update times (adding up to the report's phases), and on memstrata's
    engine its prefetch hits and I/O-token waits; the plan's table as text at step 0."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = runs[name]
    acc = EventAccumulator(str(run["metrics"]), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    steps = list(range(1, STEPS + 1))
    held, io, times, swap = (_scalars(acc, p) for p in ("strata/", "io/", "time/", "swap/"))
    assert sorted(held) == ["strata/dram_held_bytes", "strata/nvme_held_bytes"]  # no GPU: no hbm; no CXL here
    assert all(sorted(v) == steps for v in [*held.values(), *io.values(), *times.values()])
    assert all(v > 50 * 2**20 for v in held["strata/dram_held_bytes"].values())  # at least the interpreter and torch
    report = run["report"]
    # Each phase's per-step times add up to the report's total for it.
    for phase, tag in (("forward", "forward"), ("backward", "backward"), ("step", "update")):
        assert sum(times[f"time/{tag}_seconds"].values()) == pytest.approx(report["phases"][phase], rel=1e-4)
    for k in steps:
        assert sum(times[f"time/{t}_seconds"][k] for t in ("forward", "backward", "update")) \
            <= times["time/step_seconds"][k] * 1.001
    # The bytes moved each step add up to at most the run's total (setup and the export move some too); a step's
    # bandwidth is its bytes (its evaluation's included) over the wall time since the previous reading.
    nvme = report["strata"]["nvme"]
    for direction, total in (("written", nvme["bytes_written"]), ("read", nvme["bytes_read"])):
        moved = io[f"io/nvme_{direction}_bytes"]
        assert 0 <= sum(moved.values()) <= total
        rate = io[f"io/nvme_{direction}_bytes_per_second"]
        assert all(rate[k] == pytest.approx(moved[k] / times["time/interval_seconds"][k], rel=1e-4) for k in steps)
    assert all(times["time/interval_seconds"][k] >= times["time/step_seconds"][k] for k in steps)
    if name == "memstrata":  # an 8 MiB DRAM budget: every step reads and writes its state on NVMe
        assert all(v > 0 for v in io["io/nvme_read_bytes"].values()), io["io/nvme_read_bytes"]
        assert all(v > 0 for v in io["io/nvme_written_bytes"].values()), io["io/nvme_written_bytes"]
        assert all(v > 0 for v in held["strata/nvme_held_bytes"].values())
        assert {"swap/prefetch_hits", "swap/io_token_wait_seconds", "swap/forward_wait_seconds"} <= set(swap)
        assert sum(swap["swap/prefetch_hits"].values()) <= report["memstrata"]["dram"]["prefetchHits"]
    else:
        assert swap == {}  # the stock engine has no swap layer of memstrata's
    # The JSON lines carry the same numbers.
    line = next(m for m in _metrics(run) if m.get("step") == STEPS and "loss" in m)
    assert line["strata"]["io/nvme_read_bytes"] == pytest.approx(io["io/nvme_read_bytes"][STEPS])
    plan = acc.Tensors("plan/text_summary")
    assert [e.step for e in plan] == [0]
    text = plan[0].tensor_proto.string_val[0].decode()
    assert "verdict: fits" in text and "capacity" in text, text
