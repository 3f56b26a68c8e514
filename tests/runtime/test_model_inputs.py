"""Bad model, tokenizer, dataset and output inputs a user will produce fail before training, naming the path
and the problem, with nothing left under the output path or the scratch directory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="transformers is not installed: run `make install`")

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _model(tmp: Path, smollm2_dir: Path, *, vocab: int = 49152, shards: bool = False,
           config: Any = None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = config or LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=vocab, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None)
    path = tmp / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="2MB" if shards else "1GB")
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_dir / name, path / name)
    return path


def _run(cli, tmp: Path, model: Path, *, data: str | None = None, output: Path | None = None,
         architecture: str = "") -> subprocess.CompletedProcess[str]:
    dataset = tmp / "data.jsonl"
    dataset.write_text(data if data is not None else '{"text": "hello world, hello world"}\n' * 40)
    out = output or tmp / "out"
    (tmp / "job.yaml").write_text(f"""apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {{name: bad-input}}
spec:
  model: {{path: {model}{architecture}}}
  dataset: {{path: {dataset}}}
  training: {{sequenceLength: 16, steps: 1}}
  resources: {{gpus: 0}}
  output: {{path: {out}}}
""")
    scratch = tmp / "scratch"
    proc = cli("run", str(tmp / "job.yaml"), "--nvme-path", str(scratch), timeout=300)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert not scratch.exists() or not any(scratch.iterdir()), "a refused job left files in the scratch directory"
    if output is None:
        assert not out.exists() and not list(tmp.glob(".out.*")), "a refused job wrote under the output path"
    return proc


def test_directory_without_config_json(cli, tmp_path: Path, smollm2_dir: Path) -> None:
    model = _model(tmp_path, smollm2_dir)
    (model / "config.json").unlink()
    assert f"{model}/config.json: no such file" in _run(cli, tmp_path, model).stderr


def test_declared_architecture_that_differs_names_both_values(cli, tmp_path: Path, smollm2_dir: Path) -> None:
    model = _model(tmp_path, smollm2_dir)
    declared = (", architecture: {layers: 3, hidden: 32, intermediate: 64, heads: 2, kvHeads: 1, "
                "vocab: 49152}")
    err = _run(cli, tmp_path, model, architecture=declared).stderr
    assert "architecture.layers: the job declares 3, the model directory has 2" in err, err
    assert str(model / "config.json") in err


def test_a_model_built_unlike_the_shape_memstrata_read_is_refused_naming_its_type(
        cli, tmp_path: Path, smollm2_dir: Path) -> None:
    """Gemma-2 has no family here, so its config reads as Llama-shaped; its layers have four norms, not two. The
    run compares the tensors transformers builds with the planned ones (on the meta device) and refuses."""
    from transformers import Gemma2Config

    config = Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, vocab_size=49152, bos_token_id=None, eos_token_id=None,
                          pad_token_id=None, final_logit_softcapping=None)
    model = _model(tmp_path, smollm2_dir, config=config)
    proc = _run(cli, tmp_path, model)
    assert f"{model / 'config.json'}: model_type 'gemma2' read as a Llama-family model, but transformers builds " \
        in proc.stderr and "memstrata cannot plan this model's memory" in proc.stderr, proc.stderr[-2000:]
    # The first tensor Llama's layout lacks: a Gemma-2 layer's third norm, 32 wide.
    assert "first difference: model.layers.0.pre_feedforward_layernorm.weight: 32 elements built" in proc.stderr, \
        proc.stderr[-2000:]


def test_missing_shard_is_named_with_the_index(cli, tmp_path: Path, smollm2_dir: Path) -> None:
    model = _model(tmp_path, smollm2_dir, shards=True)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    lost = sorted(set(index["weight_map"].values()))[-1]
    (model / lost).unlink()
    err = _run(cli, tmp_path, model).stderr
    assert f"{model / lost}: missing (named by {model / 'model.safetensors.index.json'})" in err


def test_tokenizer_larger_than_the_vocab(cli, tmp_path: Path, smollm2_dir: Path) -> None:
    model = _model(tmp_path, smollm2_dir, vocab=1000)
    err = _run(cli, tmp_path, model).stderr
    assert "tokenizer has 49152 tokens but the model's vocabulary has 1000" in err and str(model) in err


def test_record_without_the_field(cli, tmp_path: Path, smollm2_dir: Path) -> None:
    model = _model(tmp_path, smollm2_dir)
    err = _run(cli, tmp_path, model, data='{"text": "fine"}\n{"txt": "typo"}\n').stderr
    assert f"{tmp_path / 'data.jsonl'}:2:" in err and "text" in err


def test_output_that_exists_is_never_overwritten(cli, tmp_path: Path, smollm2_dir: Path) -> None:
    model = _model(tmp_path, smollm2_dir)
    existing = tmp_path / "previous-model"
    existing.mkdir()
    (existing / "config.json").write_text("{}")
    err = _run(cli, tmp_path, model, output=existing).stderr
    assert f"spec.output.path: {existing}: already exists" in err
    assert [p.name for p in existing.iterdir()] == ["config.json"]


def test_output_on_a_directory_nobody_can_write(cli, tmp_path: Path, smollm2_dir: Path) -> None:
    if shutil.which("chattr") is None:
        pytest.fail("chattr (e2fsprogs) is missing: make install installs it")
    model = _model(tmp_path, smollm2_dir)
    locked = tmp_path / "locked"
    locked.mkdir()
    # Immutable: not even root may create an entry, like a read-only volume.
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
        pytest.skip(f"{tmp_path} is on a filesystem without the immutable attribute")
    try:
        err = _run(cli, tmp_path, model, output=locked / "out").stderr
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
    assert f"spec.output.path: {locked}: cannot create a directory there" in err


def _holds(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open or mapped (as a load reads it, mmap or not)."""
    proc = Path(f"/proc/{pid}")
    try:
        if str(path) in (proc / "maps").read_text():
            return True
        return any(os.readlink(fd) == str(path) for fd in (proc / "fd").iterdir())
    except OSError:  # the process ended, or an fd closed while being listed
        return False


def test_model_file_truncated_while_loading_fails_naming_it(tmp_path: Path, smollm2_dir: Path) -> None:
    """A copy of the real model, cut short while `memstrata run` streams its weights into ZeRO-3: a clean error
    naming the file and an orderly exit (before: SIGBUS, no message, the scratch directory left behind)."""
    model = tmp_path / "model"
    shutil.copytree(smollm2_dir, model)
    weights = model / "model.safetensors"
    scratch = tmp_path / "scratch"
    dataset = tmp_path / "data.jsonl"
    dataset.write_text('{"text": "hello world, hello world"}\n' * 40)
    (tmp_path / "job.yaml").write_text(f"""apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {{name: truncated-model}}
spec:
  model: {{path: {model}}}
  dataset: {{path: {dataset}}}
  training: {{sequenceLength: 16, steps: 1}}
  resources: {{gpus: 0}}
  memory: {{engine: deepspeed}}
""")
    proc = subprocess.Popen([sys.executable, "-m", "memstrata.cli", "run", str(tmp_path / "job.yaml"),
                             "--nvme-path", str(scratch)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    # The load: after the run said it initializes DeepSpeed (the directory was checked before), the file held.
    while not (any("initializing DeepSpeed" in line for line in lines) and _holds(proc.pid, weights)):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
        time.sleep(0.005)
    os.truncate(weights, 1 << 20)
    proc.wait(timeout=300)
    reader.join(timeout=10)
    err = "".join(lines)
    assert proc.returncode == 2, f"exit {proc.returncode} (-7 is SIGBUS)\n{err[-3000:]}"
    assert f"{weights}: truncated while being read" in err, err[-3000:]
    assert not scratch.exists() or not any(scratch.iterdir()), "a failed load left files in the scratch directory"
