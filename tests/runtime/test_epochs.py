"""training.epochs: a real `memstrata run` that counts its steps from the data and says how many passes it made;
and the refusals."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from memstrata.api.finetunejob import FineTuneJobSpec


def _job(work: Path, records: int, **training: Any) -> Path:
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"{i}+{i}={2 * i}"}) + "\n" for i in range(records)))
    job = {"apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "epochs"},
           "spec": {"model": {"preset": "gpt-tiny"}, "dataset": {"path": str(data), "packing": False},
                    "training": {"sequenceLength": 32, "microBatch": 4, "learningRate": 1e-3, "precision": "fp32",
                                 **training},
                    "resources": {"gpus": 0}, "memory": {"engine": "deepspeed"},
                    "output": {"path": str(work / "model")}}}
    (work / "job.yaml").write_text(json.dumps(job))
    (work / "nvme").mkdir()
    return work / "job.yaml"


@pytest.mark.slow
def test_epochs_become_steps_and_the_report_says_how_many_passes_ran(cli: Any, tmp_path: Path) -> None:
    """30 records, one a sequence (unpacked), 4 a step: 2.5 epochs are 75 sequences, 19 steps (rounded up), which
    draw 76 records: 2.53 passes."""
    job = _job(tmp_path, 30, epochs=2.5)
    proc = cli("run", str(job), "--nvme-path", str(tmp_path / "nvme"), "--report-json", str(tmp_path / "r.json"),
               timeout=600, env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = " ".join((proc.stdout + proc.stderr).split())
    assert "2.5 epochs of 30 sequences = 19 steps of 4 sequences" in said, said
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["steps"] == 19 and report["epochs"] == {str(tmp_path / "data.jsonl"): pytest.approx(76 / 30)}
    assert "2.53 epochs of data.jsonl" in said
    assert json.loads((tmp_path / "model" / "memstrata-run.json").read_text())["step"] == 19


def test_steps_and_epochs_are_one_or_the_other() -> None:
    base = {"model": {"preset": "gpt-tiny"}, "dataset": {"path": "/d.jsonl"}}
    for training, problem in [({}, "set exactly one of training.steps or training.epochs"),
                              ({"steps": 5, "epochs": 1}, "set exactly one of training.steps or training.epochs "
                                                          "(steps 5, epochs 1)"),
                              ({"epochs": 0}, "greater than 0")]:
        with pytest.raises(ValidationError, match=problem.replace("(", r"\(").replace(")", r"\)")):
            FineTuneJobSpec.model_validate({**base, "training": training})
    with pytest.raises(ValidationError, match="a synthetic dataset is endless and has no epochs"):
        FineTuneJobSpec.model_validate({**base, "dataset": {"synthetic": "copy"}, "training": {"epochs": 1}})


@pytest.mark.slow
def test_each_evaluation_samples_the_models_answer_as_the_saved_model_gives_it(cli: Any, tmp_path: Path) -> None:
    """training.evalSamplePrompt: the answer at each evaluation lands in metrics.jsonl, TensorBoard and the log;
    the last one is what transformers generates from the saved model (greedy, same prompt)."""
    import torch
    import transformers
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from memstrata.runtime.train.data.tokenizer import ByteTokenizer

    job = _job(tmp_path, 60, steps=30, evalInterval=15, evalSamplePrompt="12+12=", evalSampleTokens=8,
               learningRate=1e-2)
    doc = json.loads(job.read_text())
    doc["spec"]["dataset"]["validationSplit"] = 0.1
    job.write_text(json.dumps(doc))
    proc = cli("run", str(job), "--nvme-path", str(tmp_path / "nvme"), timeout=600, env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "model-metrics" / "metrics.jsonl").read_text().splitlines()]
    samples = {r["step"]: r["sample"] for r in rows if "sample" in r}
    assert sorted(samples) == [0, 15, 30], samples
    assert samples[30] and samples[30] != samples[0], samples  # trained: it answers, and not as it did before
    said = " ".join((proc.stdout + proc.stderr).split())
    assert f"sample at step 30: {samples[30]!r}" in said
    events = EventAccumulator(str(tmp_path / "model-metrics"), size_guidance={"tensors": 0}).Reload()
    assert [e.step for e in events.Tensors("validation/sample/text_summary")] == [0, 15, 30]
    bytes_ = ByteTokenizer()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    ids = torch.tensor([bytes_.encode("12+12=", first=True)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         pad_token_id=bytes_.pad_id, eos_token_id=bytes_.eos_id)[0, ids.shape[1]:].tolist()
    out = out[: out.index(bytes_.eos_id)] if bytes_.eos_id in out else out
    assert samples[30] == bytes_.decode(out).strip()
