"""Real fine-tuning of Hugging Face models: a pretrained SmolLM2 (Llama family) and small random Qwen2 (sharded,
Q/K/V bias), GPT-2, Mistral and Gemma checkpoints saved by `transformers` go in; memstrata's forward loss equals
`transformers`' own; a few steps lower the validation loss on both engines; the saved output reloads in
`transformers` and gives the trained engine's logits."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install`")

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("hf_worker.py")
DATA, VALIDATION = REPO / "examples/chat-skill.jsonl", REPO / "examples/chat-skill-val.jsonl"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

pytestmark = pytest.mark.usefixtures("deepspeed_ready")


def job_yaml(model: Path, out: Path, validation: Path, *, engine: str, precision: str, steps: int, lr: float,
             dram_budget: str | None = "256Mi") -> str:
    budget = f", dramBudget: {dram_budget}" if dram_budget else ""
    return f"""apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {{name: hf-{engine}}}
spec:
  model: {{path: {model}}}
  dataset: {{path: {DATA}, format: messages, validationPath: {validation}}}
  training: {{sequenceLength: 64, microBatch: 2, steps: {steps}, learningRate: {lr}, precision: {precision},
             activationCheckpointing: true, seed: 7}}
  resources: {{gpus: 0}}
  memory: {{engine: {engine}{budget}}}
  output: {{path: {out}, shardSize: 64Mi}}
"""


def fine_tune(tmp: Path, model: Path, **kw: Any) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor, Path]:
    work, nvme, out = tmp / "work", tmp / "nvme", tmp / "output"
    work.mkdir()
    nvme.mkdir()
    (work / "job.yaml").write_text(job_yaml(model, out, validation_file(tmp), **kw))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    probe = torch.randint(0, min(vocab, 49152), (1, 24), generator=torch.Generator().manual_seed(3))
    torch.save(probe, work / "probe.pt")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, str(WORKER), str(work / "job.yaml"), str(nvme), str(work)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((work / "result.json").read_text()), torch.load(work / "logits.pt"), probe, out


def validation_file(tmp: Path) -> Path:
    """The first 8 validation conversations: each evaluation is a forward pass per batch, with every
    parameter swapped in, so the whole file would cost minutes on 2 cores."""
    path = tmp / "validation.jsonl"
    if not path.exists():
        path.write_text("".join(VALIDATION.read_text().splitlines(keepends=True)[:8]))
    return path


def transformers_loss(model_dir: Path, precision: str, validation: Path) -> float:
    """`transformers`' own mean loss over the job's validation batches (memstrata's data pipeline)."""
    from transformers import AutoModelForCausalLM

    from memstrata.api.finetunejob import Training
    from memstrata.api.dataset import Dataset
    from memstrata.runtime.train.data.pipeline import build_data, load_tokenizer

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    data = build_data(Dataset(path=str(DATA), format="messages", validation_path=str(validation)),
                      Training(sequence_length=64, micro_batch=2, steps=1, seed=7),
                      load_tokenizer(model_dir, model.config.vocab_size))
    with torch.no_grad():
        losses = [float(model(**b.model_inputs("cpu"), use_cache=False).loss) for b in data.validation(2)]
    return sum(losses) / len(losses)


def reloaded_logits(out: Path, probe: torch.Tensor, precision: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    with torch.no_grad():
        return model(input_ids=probe).logits.float()


def check_round_trip(tmp: Path, model: Path, *, engine: str, precision: str, lr: float,
                     dram_budget: str = "256Mi") -> dict[str, Any]:
    result, logits, probe, out = fine_tune(tmp, model, engine=engine, precision=precision, steps=2, lr=lr,
                                           dram_budget=dram_budget)
    before, after = result["validation"]["0"], result["validation"]["2"]
    if precision == "fp32":
        assert before == pytest.approx(transformers_loss(model, precision, validation_file(tmp)), abs=1e-3), \
            "memstrata's forward loss differs from transformers' own on the same checkpoint and batches"
    assert after < before - 0.05, f"validation loss did not fall: {before:.4f} -> {after:.4f}"
    status = result["output"]
    assert status["path"] == str(out) and status["step"] == 2
    assert not list(out.parent.glob(f".{out.name}.partial*")), "the temporary directory was left behind"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= names, names
    # The source's stop tokens and sampling defaults survive, not a generation config derived from config.json.
    saved = json.loads((out / "generation_config.json").read_text())
    source = json.loads((model / "generation_config.json").read_text())
    assert {k: v for k, v in saved.items() if k != "transformers_version"} == \
        {k: v for k, v in source.items() if k != "transformers_version"}
    tol = 1e-4 if precision == "fp32" else 2e-2
    assert torch.allclose(reloaded_logits(out, probe, precision), logits, atol=tol, rtol=tol), \
        "the saved model does not reproduce the trained engine's logits"
    return result


def test_smollm2_fine_tunes_on_memstrata_and_reloads(tmp_path: Path, smollm2_dir: Path) -> None:
    # fp32, so the loss can be held to transformers' within 1e-3; the budget leaves nearly all the weights and
    # all the optimizer state (the embedding's a slice at a time) to the NVMe stratum.
    result = check_round_trip(tmp_path, smollm2_dir, engine="memstrata", precision="fp32", lr=1e-4,
                              dram_budget="800Mi")
    # The weights were built into, loaded into and trained from memstrata's NVMe stratum: at least the whole
    # fp32 model went through it.
    assert result["param_bytes_written"] >= 134_515_008 * 4, "the weights never went through memstrata's swap layer"


def test_smollm2_fine_tunes_on_stock_deepspeed_and_reloads(tmp_path: Path, smollm2_dir: Path) -> None:
    # Stock ZeRO-3 with its state offloaded to DRAM: its NVMe pools would not fit a small budget here
    # (the swap-layer comparison lives in benchmarks/offload).
    check_round_trip(tmp_path, smollm2_dir, engine="deepspeed", precision="bf16", lr=1e-4, dram_budget=None)


def _small(tmp: Path, family: str, smollm2_dir: Path) -> Path:
    """A small random checkpoint of `family`, saved by transformers itself, with SmolLM2's tokenizer."""
    from transformers import (AutoModelForCausalLM, GemmaConfig, GPT2Config, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config)

    common = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    config = {
        "qwen2": Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, **common),
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **{**common, "tie_word_embeddings": True}),
        # Heads narrower than hidden / heads, as Mistral-NeMo's (4 of 8 at hidden 64), and wider, as Gemma-7B's.
        "mistral": MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=8, sliding_window=32, **common),
        # Gemma ties its head by default (its config.json then leaves tie_word_embeddings out).
        "gemma": GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=32, **{**common, "tie_word_embeddings": True}),
        # Q/K/V and gate/up fused in one tensor each.
        "phi3": Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, **common),
        # A norm over every query and key head, the heads wider than hidden / heads (as Qwen3-0.6B's).
        "qwen3": Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, **common),
    }[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    path = tmp / f"{family}-small"
    # Qwen2 is saved in several shards with an index, as large checkpoints are.
    model.generation_config.update(eos_token_id=[2, 0], temperature=0.7, do_sample=True)  # a source's own settings
    model.save_pretrained(path, max_shard_size="4MB" if family == "qwen2" else "1GB")
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_dir / name, path / name)
    return path


@pytest.mark.parametrize("family", ["qwen2", "gpt2", "mistral", "gemma", "phi3", "qwen3"])
def test_families_load_train_and_reload(tmp_path: Path, smollm2_dir: Path, family: str) -> None:
    model = _small(tmp_path, family, smollm2_dir)
    if family == "qwen2":
        assert (model / "model.safetensors.index.json").exists(), "the Qwen2 checkpoint should be sharded"
    # The shape memstrata reads from config.json lays out the tensors transformers builds from it, one for one.
    from transformers import AutoConfig, AutoModelForCausalLM

    from memstrata.api.hfconfig import architecture_from_config

    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    shape = architecture_from_config(json.loads((model / "config.json").read_text()))
    assert shape.tensor_sizes() == [p.numel() for p in built.parameters()]
    # These small models are almost all embedding (one sub-group of its own): streaming it would need buffers of
    # its size, so the plan keeps everything in DRAM - the memstrata engine's all-DRAM run, with no namespace.
    check_round_trip(tmp_path, model, engine="memstrata", precision="fp32", lr=1e-3, dram_budget="128Mi")
