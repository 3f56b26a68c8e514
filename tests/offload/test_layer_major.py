"""Layer-major micro-batches on the real engine (memstrata.runtime.train.model.layermajor): a Llama-family model
whose weights the plan puts on NVMe, trained through FineTuneRecipe with gradientAccumulation 3, reads each
weight on NVMe once a forward and once a backward per step, where the same job run one micro-batch at a time
reads it about twice per micro-batch; and it trains to the same losses. Full fine-tune (the embedding's output
needs a gradient) and LoRA (the frozen base on NVMe, the first layer's input needs none)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install`")

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("layer_major_worker.py")
ACCUMULATION = 3

pytestmark = pytest.mark.usefixtures("deepspeed_ready")


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 layers of hidden 256 over a 512-token vocabulary (a byte-level tokenizer of 259): the layers are most of
    the weights, as in a real model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("llama") / "small-llama"
    vocab = {f"<{i}>": i for i in range(3)}
    vocab.update({ch: 3 + i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<1>", eos_token="<2>", pad_token="<2>",
                            unk_token="<0>").save_pretrained(path)
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _run(tmp: Path, model: Path, name: str, training: str, budget: str, gpu: bool = False) -> dict[str, Any]:
    work = tmp / name
    (work / "nvme").mkdir(parents=True)
    (work / "job.yaml").write_text(f"""apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {{name: {name}}}
spec:
  model: {{path: {model}}}
  dataset: {{synthetic: arithmetic}}
  training: {{sequenceLength: 64, microBatch: 2, gradientAccumulation: {ACCUMULATION}, steps: 3,
             learningRate: 1.0e-3, precision: {"bf16" if gpu else "fp32"}, seed: 5, {training}}}
  resources: {{gpus: {int(gpu)}}}
  memory: {{engine: memstrata, dramBudget: {budget}}}
""")
    proc = subprocess.run([sys.executable, str(WORKER), str(work / "job.yaml"), str(work / "nvme"),
                           str(work / "out.json")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DS_ACCELERATOR": "cuda" if gpu else "cpu"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((work / "out.json").read_text())


def _reads_per_weight_byte(run: dict[str, Any]) -> list[float]:
    """How many times each step read each byte of the weights on NVMe. The first step counts too: ZeRO-3 learns
    the order of its modules in it, and from then on its prefetcher alone keeps a parameter gathered whose next
    use is close (layer-major, the next micro-batch's); in the first step only the holds do."""
    assert run["weights_on_nvme"] > 0, "the plan kept the weights in DRAM: nothing to measure"
    return [r / run["weights_on_nvme"] for r in run["param_reads"]]


@pytest.mark.parametrize(("method", "budget"), [("method: full", "70Mi"), ("method: lora, lora: {dropout: 0}",
                                                                          "20Mi")], ids=["full", "lora"])
def test_a_step_reads_each_weight_once_a_pass_and_trains_as_one_micro_batch_at_a_time(
        tmp_path: Path, small_llama: Path, method: str, budget: str) -> None:
    on = _run(tmp_path, small_llama, "layer-major", method, budget)  # layerMajor unset: the planner's choice
    off = _run(tmp_path, small_llama, "one-at-a-time", f"{method}, layerMajor: false", budget)
    assert on["layer_major"] and on["runs_layer_major"] and not off["layer_major"]
    assert on["micro_batch_config"] == 2 * ACCUMULATION and off["micro_batch_config"] == 2
    # Layer-major holds each micro-batch's checkpoints at once, so its plan has more of them.
    assert on["checkpoints"] == ACCUMULATION * off["checkpoints"]
    layer_major, one_at_a_time = _reads_per_weight_byte(on), _reads_per_weight_byte(off)
    print(f"\n{method}: each weight byte on NVMe read per step {[round(r, 2) for r in layer_major]} layer-major, "
          f"{[round(r, 2) for r in one_at_a_time]} one micro-batch at a time ({ACCUMULATION} micro-batches)")
    # Once in forward, once in backward (the first step also reads what building the model left behind).
    assert max(layer_major) <= 2.05, on["param_reads"]
    assert min(one_at_a_time) >= 1.5 * ACCUMULATION, off["param_reads"]
    # The same micro-batches, the same per-micro-batch losses: only the order of autograd's gradient sums differs.
    assert on["losses"] == pytest.approx(off["losses"], rel=1e-5)
    assert on["losses"][-1] < on["losses"][0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the held layer's parameters gathered into HBM, "
                                                          "released with their copies' streams")
def test_on_a_gpu_a_step_reads_each_weight_once_a_pass_and_trains_as_one_micro_batch_at_a_time(
        tmp_path: Path, small_llama: Path) -> None:
    on = _run(tmp_path, small_llama, "layer-major", "method: full", "50Mi", gpu=True)
    off = _run(tmp_path, small_llama, "one-at-a-time", "method: full, layerMajor: false", "50Mi", gpu=True)
    assert on["runs_layer_major"] and not off["runs_layer_major"]
    assert max(_reads_per_weight_byte(on)) <= 2.05, on["param_reads"]
    # bf16: autograd sums the micro-batches' gradients in another order than DeepSpeed's accumulation.
    assert on["losses"] == pytest.approx(off["losses"], rel=2e-2)


def test_a_checkpoint_resumes_across_the_schedules_on_a_step_boundary(tmp_path: Path) -> None:
    """A checkpoint taken layer-major (one DeepSpeed micro-step a step) resumes one micro-batch at a time (three)
    and trains the steps an uninterrupted run trains: DeepSpeed's micro-step counter is set for the schedule that
    resumes, or its accumulation boundary would fall after the first micro-batch of the next step."""
    import yaml
    from offload_helpers import resume_attempt

    def job(name: str, steps: int, layer_major: bool) -> Path:
        doc = yaml.safe_load((REPO / "examples" / "finetune-tiny.yaml").read_text())
        doc["metadata"]["name"] = "across"
        doc["spec"]["training"].update(steps=steps, gradientAccumulation=ACCUMULATION, microBatch=2,
                                       precision="fp32", layerMajor=layer_major)
        doc["spec"]["checkpoint"] = {"path": str(tmp_path / f"{name}-ckpt"), "everySteps": 2, "keep": 2}
        path = tmp_path / f"{name}-{steps}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return path

    (tmp_path / "nvme").mkdir()
    whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
    for path, losses in ((job("whole", 4, True), whole), (job("parts", 2, True), parts),
                         (job("parts", 4, False), parts)):
        proc = resume_attempt(path, tmp_path, losses)
        assert proc.returncode == 0, proc.stderr[-3000:]

    def steps(losses: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in losses.read_text().splitlines()]
        return {r["step"]: float.fromhex(r["loss"]) for r in rows if "step" in r}

    resumed = [json.loads(line)["attempt_resumed_from"] for line in parts.read_text().splitlines()
               if "attempt_resumed_from" in line]
    assert resumed == [0, 2]
    expected, got = steps(whole), steps(parts)
    assert sorted(got) == [1, 2, 3, 4]
    assert [got[s] for s in range(1, 5)] == pytest.approx([expected[s] for s in range(1, 5)], rel=1e-5)
