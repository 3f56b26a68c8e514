"""The best model kept and early stopping, on a real `memstrata run` whose validation loss falls and then rises
(a learning rate that warms up far past what gpt-tiny can take): the run stops `patience` evaluations after its
best, and the output is the model of the best evaluation, whose validation loss, measured again by transformers
from the saved files, is the one the run recorded."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: run `make install`")

from memstrata.api.dataset import Dataset  # noqa: E402
from memstrata.api.finetunejob import Training  # noqa: E402
from memstrata.runtime.train.data.pipeline import ByteTokenizer, build_data  # noqa: E402

pytestmark = pytest.mark.slow
STEPS, EVERY, PATIENCE = 24, 2, 2


def _job(work: Path, **training: Any) -> Path:
    rng = random.Random(5)
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"{a}+{b}={a + b}"}) + "\n"
                            for a, b in ((rng.randrange(1000), rng.randrange(1000)) for _ in range(400))))
    job = {"apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "best"},
           "spec": {"model": {"preset": "gpt-tiny"}, "dataset": {"path": str(data), "validationSplit": 0.1},
                    "training": {"sequenceLength": 64, "microBatch": 4, "steps": STEPS, "learningRate": 0.3,
                                 "precision": "fp32", "seed": 3, "evalInterval": EVERY,
                                 "schedule": {"type": "linear", "warmupSteps": STEPS}, **training},
                    "resources": {"gpus": 0}, "memory": {"engine": "deepspeed"},
                    "output": {"path": str(work / "model")}}}
    (work / "job.yaml").write_text(json.dumps(job))
    (work / "nvme").mkdir()
    return work / "job.yaml"


def _validation_loss(model_dir: Path, data: Path) -> float:
    """What the run's evaluation computes (the mean of the validation micro-batches' losses), by transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batches = build_data(Dataset(path=str(data), validation_split=0.1),
                         Training(steps=1, sequence_length=64, micro_batch=4, seed=3), ByteTokenizer()).validation(4)
    with torch.no_grad():
        losses = [float(model(**b.model_inputs("cpu"), use_cache=False).loss) for b in batches]
    return sum(losses) / len(losses)


def test_the_best_model_is_kept_and_the_run_stops_after_its_patience(cli: Any, tmp_path: Path) -> None:
    job = _job(tmp_path, keepBest=True, earlyStopping={"patience": PATIENCE})
    proc = cli("run", str(job), "--nvme-path", str(tmp_path / "nvme"), "--report-json", str(tmp_path / "r.json"),
               timeout=600, env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "model-metrics" / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r["validation_loss"] for r in rows if r.get("validation_loss") is not None and r["step"]}
    best = min(evaluated, key=evaluated.__getitem__)
    last = max(r["step"] for r in rows)
    assert best < last < STEPS, (evaluated, "the validation loss should fall, then rise, and the run stop early")
    assert last == best + PATIENCE * EVERY, evaluated  # stopped at the patience-th evaluation without improvement
    run = json.loads((tmp_path / "model" / "memstrata-run.json").read_text())
    assert (run["step"], run["validationLoss"], run["runSteps"]) == (best, evaluated[best], STEPS)
    assert _validation_loss(tmp_path / "model", tmp_path / "data.jsonl") == pytest.approx(evaluated[best], rel=1e-4)
    assert not list(tmp_path.glob(".model.*")), "a staged best model or partial output was left behind"
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["output"]["step"] == best and report["kept_best"]
    assert report["stopped_early"].startswith(f"stopped early after step {last}: the validation loss did not improve")
    said = " ".join(proc.stdout.split())
    assert f"step {best}, the lowest validation loss" in said and "stopped early after step" in said
    from huggingface_hub import ModelCard

    card = ModelCard.load(tmp_path / "model" / "README.md")  # the Hub's own reader of the card
    assert (card.data.base_model, card.data.library_name) == ("gpt-tiny", "transformers")
    assert f"the model of step {best}." in card.text and "full fine-tune" in card.text
    assert f"{evaluated[best]:.4f} at step {best}" in card.text and f"at step {last}" not in card.text


def test_each_checkpoint_carries_a_model_transformers_loads_and_the_run_resumes_past_it(cli: Any,
                                                                                      tmp_path: Path) -> None:
    """checkpoint.exportModel: every kept checkpoint has the model of its step in Hugging Face format, written while
    the run went on (its validation loss is the one the run measured at that step), and a run resumes from such a
    checkpoint."""
    job = _job(tmp_path, learningRate=3e-3, schedule={"type": "constant"})
    doc = json.loads(job.read_text())
    doc["spec"]["checkpoint"] = {"path": str(tmp_path / "ckpt"), "everySteps": 2, "keep": 2, "exportModel": True}
    job.write_text(json.dumps(doc))
    proc = cli("run", str(job), "--nvme-path", str(tmp_path / "nvme"), "--steps", "6", timeout=600,
               env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "model-metrics" / "metrics.jsonl").read_text().splitlines()]
    measured = {r["step"]: r["validation_loss"] for r in rows if r.get("validation_loss") is not None}
    kept = sorted((tmp_path / "ckpt").glob("step-*"))
    assert [p.name for p in kept] == ["step-00000004", "step-00000006"]
    for step_dir in kept:
        step = int(step_dir.name.split("-")[1])
        assert json.loads((step_dir / "model" / "memstrata-run.json").read_text())["step"] == step
        assert _validation_loss(step_dir / "model", tmp_path / "data.jsonl") == pytest.approx(measured[step], rel=1e-4)
    import shutil

    shutil.rmtree(tmp_path / "model")
    proc = cli("run", str(job), "--nvme-path", str(tmp_path / "nvme"), "--steps", "8", "--resume", timeout=600,
               env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr and "step 6 of 8" in " ".join((proc.stdout + proc.stderr).split())
    assert (tmp_path / "ckpt" / "step-00000008" / "model" / "config.json").is_file()
    # Each checkpoint records where the choice of the best model stood: the lowest loss measured up to its step.
    manifest = json.loads((tmp_path / "ckpt" / "step-00000006" / "checkpoint.json").read_text())
    after = {s: v for s, v in measured.items() if 0 < s <= 6}
    best = min(after, key=after.__getitem__)
    assert manifest["selection"]["bestStep"] == best and manifest["selection"]["bestLoss"] == pytest.approx(after[best])


def _selection(**training: Any) -> Any:
    from memstrata.runtime.train.best import Selection

    return Selection(Training(steps=40, **training), None, leader=True)


@pytest.mark.parametrize("stop_after", [2, 3, 4])
def test_early_stopping_resumed_from_a_checkpoint_stops_where_an_uninterrupted_run_does(stop_after: int) -> None:
    """The patience count and the best so far travel in the checkpoint's manifest (Selection.state): a run resumed
    after any evaluation stops at the same evaluation as one never interrupted."""
    from memstrata.api.checkpoint import SelectionState
    from memstrata.runtime.train.best import Selection

    losses = [3.0, 2.0, 1.5, 1.6, 1.7, 1.55, 1.8, 1.9]  # best at the 3rd evaluation; patience 3 ends it at the 6th
    early = {"patience": 3, "minDelta": 0.01}

    def run(selection: Any, evaluations: list[tuple[int, float]]) -> int | None:
        for step, loss in evaluations:
            selection.observe(step, loss, lambda *_: None)
            if selection.stop_reason is not None:
                return step
        return None

    evaluations = [(2 * (i + 1), loss) for i, loss in enumerate(losses)]
    whole = run(_selection(early_stopping=early), evaluations)
    assert whole == 12
    first = _selection(early_stopping=early)
    assert run(first, evaluations[:stop_after]) is None
    saved = SelectionState.model_validate_json(first.state().model_dump_json(by_alias=True))  # as the manifest holds it
    resumed = Selection(Training(steps=40, early_stopping=early), None, leader=True,
                        resumed_step=evaluations[stop_after - 1][0], resumed=saved)
    assert run(resumed, evaluations[stop_after:]) == whole
    assert resumed.stop_reason is not None and "on 1.5000 (step 6) for 3 evaluations" in resumed.stop_reason
