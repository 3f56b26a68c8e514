"""Helpers shared by the swap-layer tests (a uniquely named module: every test dir has a conftest)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "benchmarks" / "offload" / "harness.py"


def harness_cmd(engine: str, out: Path, swap_dir: Path, *, steps: int, preset: str = "gpt-tiny",
                nvme: list[str] | None = None, swap: dict[str, Any] | None = None, extra: list[str] | None = None
                ) -> list[str]:
    cmd = [sys.executable, str(HARNESS), "--engine", engine, "--preset", preset, "--steps", str(steps),
           "--swap-dir", str(swap_dir), "--out", str(out)]
    if nvme:
        cmd += ["--nvme", ",".join(nvme)]
    if swap:
        cmd += ["--swap-json", json.dumps(swap)]
    return cmd + (extra or [])


def run_harness(engine: str, tmp: Path, *, steps: int, timeout: float = 900, **kw: Any) -> dict[str, Any]:
    out = tmp / f"{engine}.json"
    swap_dir = tmp / f"{engine}-swap"
    cmd = harness_cmd(engine, out, swap_dir, steps=steps, **kw)
    env = {**os.environ, "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"{engine} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["swap_dir"] = str(swap_dir)
    return result


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def resume_attempt(job: Path, tmp: Path, losses: Path, kill: str | None = None) -> subprocess.CompletedProcess[str]:
    """One attempt of `job` through resume_worker.py (resuming when a checkpoint is there), its step losses
    appended to `losses`; `kill`: `phase:step:marker`, where the worker SIGKILLs itself."""
    args = [sys.executable, str(Path(__file__).resolve().parent / "resume_worker.py"), str(job), str(tmp / "nvme"),
            str(losses)]
    if kill is not None:
        args += ["--kill", kill]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONHASHSEED": "0"}
    return subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=tmp)


CHAT_DATA, CHAT_VALIDATION = REPO / "examples/chat-skill.jsonl", REPO / "examples/chat-skill-val.jsonl"


def run_lora_job(tmp: Path, model: Path, lora: str, steps: int, memory: str = "engine: memstrata") -> dict[str, Any]:
    """A LoRA fine-tune of `model` (`lora`: the body of spec.training.lora, as YAML flow) through hf_worker.py, with
    the job `peft_reference` trains the same way: the chat-skill example's conversations (the first 8 for
    validation, since every evaluation streams the whole model), sequences of 64, micro-batches of 2, lr 2e-3, fp32
    (the reloaded logits can be held to the engine's within 1e-4), seed 7. The worker's result, its logits on a
    seeded probe, and the paths a check needs."""
    import torch

    work, nvme, out, validation = tmp / "work", tmp / "nvme", tmp / "output", tmp / "validation.jsonl"
    work.mkdir()
    nvme.mkdir()
    validation.write_text("".join(CHAT_VALIDATION.read_text().splitlines(keepends=True)[:8]))
    (work / "job.yaml").write_text(f"""apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {{name: lora-{model.name.lower()}}}
spec:
  model: {{path: {model}}}
  dataset: {{path: {CHAT_DATA}, format: messages, validationPath: {validation}}}
  training: {{method: lora, lora: {{{lora}}}, sequenceLength: 64, microBatch: 2, steps: {steps}, learningRate: 2.0e-3,
             precision: fp32, seed: 7}}
  resources: {{gpus: 0}}
  memory: {{{memory}}}
  output: {{path: {out}, shardSize: 64Mi}}
""")
    probe = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(3))
    torch.save(probe, work / "probe.pt")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("hf_worker.py")), str(work / "job.yaml"),
                           str(nvme), str(work)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"result": json.loads((work / "result.json").read_text()), "logits": torch.load(work / "logits.pt"),
            "probe": probe, "out": out, "base": model, "validation": validation}


def peft_reference(base: Path, validation: Path, lora: dict[str, Any], steps: int) -> tuple[list[float], Any]:
    """A LoRA fine-tune of `base` in plain PyTorch + PEFT (`lora`: LoraConfig's arguments), no DeepSpeed, on the
    chat-skill example's data through memstrata's pipeline (sequences of 64, micro-batches of 2, seed 7) with
    torch's AdamW at the LoRA tests' settings (lr 2e-3, clipping 1.0): (step losses, the trained PeftModel)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from memstrata.api.dataset import Dataset
    from memstrata.api.finetunejob import Training
    from memstrata.runtime.train.data.pipeline import build_data, load_tokenizer

    data = build_data(Dataset(path=str(CHAT_DATA), format="messages", validation_path=str(validation)),
                      Training(sequence_length=64, micro_batch=2, steps=steps, seed=7), load_tokenizer(base, 49152))
    torch.manual_seed(7)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **lora))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    batches, losses = data.batches(2, start=0, rank=0, world=1), []
    for _ in range(steps):
        loss = model(**next(batches).model_inputs("cpu"), use_cache=False).loss  # packed examples kept apart
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model
