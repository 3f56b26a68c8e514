"""model.addedTokens on SmolLM2: the tokens become single special tokens, the tied embedding grows by a row per
token (which the planner counts), the new rows start at the mean of the others and the old ones are the
checkpoint's, and the output is a model and tokenizer transformers loads with the new vocabulary."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: run `make install`")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("deepspeed_ready")]
TOKENS = ["<|tool_call|>", "<|tool_result|>"]
VOCAB = 49152


def _job(tmp: Path, model: Path, **model_fields: Any) -> Path:
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"ask {i} {TOKENS[0]}add({i}){TOKENS[1]}{2 * i}"}) + "\n"
                            for i in range(16)))
    job = {"apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "tokens"},
           "spec": {"model": {"path": str(model), **model_fields}, "dataset": {"path": str(data)},
                    # A rate so small the weights stay where they started, to the last bit that matters here.
                    "training": {"sequenceLength": 64, "microBatch": 2, "steps": 1, "learningRate": 1e-12,
                                 "precision": "fp32"},
                    "resources": {"gpus": 0}, "memory": {"engine": "deepspeed"},
                    "output": {"path": str(tmp / "out")}}}
    (tmp / "job.yaml").write_text(json.dumps(job))
    (tmp / "nvme").mkdir(exist_ok=True)
    return tmp / "job.yaml"


def test_added_tokens_grow_the_vocabulary_as_planned(cli: Any, tmp_path: Path, smollm2_dir: Path) -> None:
    job = _job(tmp_path, smollm2_dir, addedTokens=TOKENS)
    (tmp_path / "base").mkdir()
    plan, base = cli("plan", str(job), "--json"), cli("plan", str(_job(tmp_path / "base", smollm2_dir)), "--json")
    grown, plain = json.loads(plan.stdout)["parameters"], json.loads(base.stdout)["parameters"]
    assert grown - plain == len(TOKENS) * 576  # one tied embedding row of hidden 576 per token
    proc = cli("run", str(job), "--nvme-path", str(tmp_path / "nvme"), timeout=900, env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert [tokenizer.convert_tokens_to_ids(t) for t in TOKENS] == [VOCAB, VOCAB + 1]
    assert tokenizer(f"x{TOKENS[0]}y", add_special_tokens=False)["input_ids"].count(VOCAB) == 1
    assert json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB + len(TOKENS)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    original = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    rows, old = model.get_input_embeddings().weight.detach(), original.get_input_embeddings().weight.detach()
    assert rows.shape == (VOCAB + len(TOKENS), 576)
    assert torch.allclose(rows[:VOCAB], old, atol=1e-6)
    assert torch.allclose(rows[VOCAB:], old.mean(0).expand(len(TOKENS), -1), atol=1e-6)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_added_tokens_are_refused_where_they_cannot_train(cli: Any, tmp_path: Path, smollm2_dir: Path) -> None:
    job = _job(tmp_path, smollm2_dir, addedTokens=TOKENS)
    doc = json.loads(job.read_text())
    doc["spec"]["training"]["method"] = "lora"
    job.write_text(json.dumps(doc))
    proc = cli("plan", str(job))
    assert proc.returncode == 2 and "model.addedTokens with training.method lora" in proc.stderr, proc.stderr


def test_a_token_the_tokenizer_has_or_a_padded_vocabulary_is_refused(smollm2_dir: Path) -> None:
    """New tokens must land on the rows the model grows by: not a token the tokenizer has, and not a tokenizer
    smaller than its model's vocabulary (its next ids are existing padding rows)."""
    from memstrata.runtime.train.data.pipeline import DatasetError, load_tokenizer
    from memstrata.runtime.train.data.tokenizer import add_tokens

    with pytest.raises(DatasetError, match=r"model.addedTokens: <\|im_end\|> already in"):
        add_tokens(load_tokenizer(smollm2_dir, VOCAB), ["<|new|>", "<|im_end|>"], rows=VOCAB)
    with pytest.raises(DatasetError, match=r"has 49152 tokens and the model's vocabulary 49216 rows"):
        add_tokens(load_tokenizer(smollm2_dir, VOCAB + 64), ["<|new|>"], rows=VOCAB + 64)
