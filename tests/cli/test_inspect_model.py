"""`memstrata inspect-model DIR`: what the operator's inspection pod runs. It prints a model directory's shape as
the ModelArchitecture wire JSON and writes it to the termination log (where the kubelet picks it up); a
directory it cannot read is one line naming the file and the problem, in both places, and exit 2. `memstrata
plan` reads an architecture-less model.path the same way."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memstrata.api.architecture import PRESETS, ModelArchitecture

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def _model(tmp_path: Path, config: object | str) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d


def _log(tmp_path: Path) -> Path:
    log = tmp_path / "termination-log"
    log.write_text("")  # the kubelet creates it; the command writes only into an existing file
    return log


def test_prints_the_shape_and_writes_it_to_the_termination_log(cli, tmp_path: Path) -> None:
    log = _log(tmp_path)
    out = cli("inspect-model", str(_model(tmp_path, LLAMA3_8B)), "--termination-log", str(log))
    assert out.returncode == 0, out.stderr
    arch = ModelArchitecture.model_validate_json(out.stdout)
    # The Llama-3-8B preset's shape, except its positions (a gpt-only field the preset leaves at the default).
    assert arch.model_copy(update={"max_positions": 2048}) == PRESETS["llama3-8b"]
    assert ModelArchitecture.model_validate_json(log.read_text()) == arch
    assert len(log.read_bytes()) < 4096  # the kubelet keeps at most 4 KiB of a termination message


def test_no_termination_log_file_means_stdout_only(cli, tmp_path: Path) -> None:
    absent = tmp_path / "nowhere" / "termination-log"
    out = cli("inspect-model", str(_model(tmp_path, LLAMA3_8B)), "--termination-log", str(absent))
    assert out.returncode == 0, out.stderr
    assert not absent.exists() and not absent.parent.exists()


@pytest.mark.parametrize("config,expect", [
    (None, "config.json: no such file; model.path must be a Hugging Face model directory"),
    ("{not json", "config.json: not valid JSON: Expecting property name enclosed in double quotes at line 1"),
    ({**LLAMA3_8B, "architectures": ["BertForMaskedLM"]}, "not a causal language model"),
    ({k: v for k, v in LLAMA3_8B.items() if k != "num_hidden_layers"}, "no num_hidden_layers or n_layer"),
    ({**LLAMA3_8B, "hidden_size": -1}, "config.json: hidden_size must be a positive integer, got -1"),
], ids=["no-config", "bad-json", "not-causal-lm", "missing-field", "bad-field"])
def test_a_directory_it_cannot_read_is_named_with_the_problem(cli, tmp_path: Path, config, expect: str) -> None:
    log = _log(tmp_path)
    if config is None:
        (tmp_path / "model").mkdir()
    else:
        _model(tmp_path, config)
    out = cli("inspect-model", str(tmp_path / "model"), "--termination-log", str(log))
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"memstrata: error: {tmp_path / 'model'}") and expect in line, line
    assert expect in log.read_text() and str(tmp_path / "model") in log.read_text()


def test_a_missing_directory(cli, tmp_path: Path) -> None:
    out = cli("inspect-model", str(tmp_path / "absent"), "--termination-log", str(_log(tmp_path)))
    assert out.returncode == 2 and f"{tmp_path / 'absent'}: no such directory" in out.stderr


JOB = """apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {name: from-dir}
spec:
  model: {path: MODEL}
  dataset: {synthetic: copy}
  training: {steps: 4, sequenceLength: 4096}
"""


def test_plan_reads_the_shape_of_an_architectureless_model_path(cli, tmp_path: Path, repo: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("MODEL", str(_model(tmp_path, LLAMA3_8B))))
    out = cli("plan", str(job), "--node", str(repo / "examples/node-cxl.yaml"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["parameters"] == 8_030_261_248  # Llama-3-8B's, read from config.json


def test_plan_names_the_model_file_it_cannot_read(cli, tmp_path: Path, repo: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("MODEL", str(_model(tmp_path, "[]"))))
    out = cli("plan", str(job), "--node", str(repo / "examples/node-cxl.yaml"))
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert f"{job}: spec.model.path: {tmp_path / 'model' / 'config.json'}: expected a JSON object" in line, line


def test_plan_refuses_a_read_shape_that_does_not_suit_the_job(cli, tmp_path: Path, repo: Path) -> None:
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
            "vocab_size": 300, "n_positions": 1024}
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("MODEL", str(_model(tmp_path, gpt2))))
    out = cli("plan", str(job), "--node", str(repo / "examples/node-cxl.yaml"))
    assert out.returncode == 2
    assert "training.sequenceLength (4096) exceeds the model's 1024 positions" in out.stderr, out.stderr
