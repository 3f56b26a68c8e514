"""NEFTune: noise on the input embeddings while training, none while evaluating; checked on a transformers model
directly and in a real `memstrata run`."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: run `make install`")

from memstrata.runtime.train.model.neftune import install_neftune  # noqa: E402


def test_noise_is_bounded_by_alpha_over_root_length_times_width_and_only_in_training() -> None:
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 300, (2, 50))
    clean = model.get_input_embeddings()(ids).detach()
    install_neftune(model, alpha=5.0)
    bound = 5.0 / math.sqrt(50 * 64)
    model.train()
    noisy = model.get_input_embeddings()(ids).detach()
    delta = (noisy - clean).abs()
    assert delta.max() <= bound * (1 + 1e-5)
    assert delta.mean() == pytest.approx(bound / 2, rel=0.05)  # uniform in [-m, m]: mean |x| = m / 2
    model.eval()
    assert torch.equal(model.get_input_embeddings()(ids), clean)


def _run(cli: Any, tmp: Path, name: str, alpha: float | None) -> list[dict[str, Any]]:
    work = tmp / name
    work.mkdir()
    rng = random.Random(5)
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"{a}+{b}={a + b}"}) + "\n"
                            for a, b in ((rng.randrange(1000), rng.randrange(1000)) for _ in range(200))))
    training: dict[str, Any] = {"sequenceLength": 64, "microBatch": 4, "steps": 3, "learningRate": 3e-3,
                                "precision": "fp32", "seed": 3}
    if alpha is not None:
        training["neftuneNoiseAlpha"] = alpha
    job = {"apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": name},
           "spec": {"model": {"preset": "gpt-tiny"}, "dataset": {"path": str(data), "validationSplit": 0.1},
                    "training": training, "resources": {"gpus": 0}, "memory": {"engine": "deepspeed"},
                    "output": {"path": str(work / "model")}}}
    (work / "job.yaml").write_text(json.dumps(job))
    (work / "nvme").mkdir()
    proc = cli("run", str(work / "job.yaml"), "--nvme-path", str(work / "nvme"), timeout=600,
               env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (work / "model-metrics" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_run_with_neftune_trains_on_noisy_embeddings_and_validates_on_clean_ones(cli: Any, tmp_path: Path) -> None:
    """The same seed and data: the validation loss before the first step is the same (no noise in evaluation),
    the first step's training loss is not (noise in training)."""
    plain, noisy = _run(cli, tmp_path, "plain", None), _run(cli, tmp_path, "noisy", 15.0)

    def first(rows: list[dict[str, Any]], key: str) -> float:
        return next(r[key] for r in rows if r.get(key) is not None)

    assert first(plain, "validation_loss") == first(noisy, "validation_loss")
    assert first(plain, "loss") != first(noisy, "loss")
