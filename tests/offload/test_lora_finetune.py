"""LoRA (`training.method: lora`) on a real pretrained model: SmolLM2-135M-Instruct fine-tuned through memstrata's
swap layer, with the frozen base weights partly on the NVMe stratum, as plain LoRA and as DoRA (`useDora`, whose
magnitude module reads the partitioned base weight in its own forward). The validation loss falls; the steps are
plain PEFT's; the adapter the run wrote loads with `peft` over the untouched base model and gives the trained
engine's logits; the merged model loads with plain `transformers` and gives them too; every tensor no adapter
touches is the base's, bit for bit, and every targeted weight is the base's plus exactly scaling·B·A (LoRA) or
what PEFT's own merge makes of the saved adapter (DoRA)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from offload_helpers import peft_reference, run_lora_job

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install`")
pytest.importorskip("peft", reason="peft is not installed: run `make install`")

RANK, ALPHA, STEPS = 8, 16.0, 3

pytestmark = pytest.mark.usefixtures("deepspeed_ready")


@pytest.fixture(scope="module", params=["lora", "dora"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            smollm2_dir: Path) -> dict[str, Any]:
    """One LoRA run (about a minute on 2 cores) of each variant, shared by the checks below."""
    dora = request.param == "dora"
    # A budget below the 538 MB of fp32 weights puts part of the frozen base on NVMe.
    lora = (f"rank: {RANK}, alpha: {ALPHA}, targetModules: [q_proj, v_proj, down_proj], dropout: 0.0, useRslora: true, "
            f"useDora: {str(dora).lower()}, mergeOnSave: true")
    run = run_lora_job(tmp_path_factory.mktemp(request.param), smollm2_dir, lora, STEPS,
                       memory="engine: memstrata, dramBudget: 256Mi")
    return {**run, "dora": dora}


def _logits(model: Any, probe: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=probe).logits.float()


def test_lora_lowers_the_validation_loss(trained: dict[str, Any]) -> None:
    result = trained["result"]
    before, after = result["validation"]["0"], result["validation"][str(STEPS)]
    assert after < before - 0.05, f"validation loss did not fall: {before:.4f} -> {after:.4f}"
    # The base weights streamed through memstrata's NVMe stratum (the budget is below the fp32 model), written
    # when the model was built and again when its weights were loaded (DoRA: once more for the targeted ones, as
    # PEFT gathers each to take its norm), and never after: nothing updates them. (A full fine-tune writes its
    # spilled weights back at every step.)
    built, written = result["param_bytes_written_at_setup"], result["param_bytes_written"]
    targeted = 30 * 4 * (576 * 576 + 576 * 192 + 1536 * 576)  # fp32 q_proj, v_proj and down_proj of 30 layers
    assert 0 < built <= 2 * 134_515_008 * 4 + (targeted if trained["dora"] else 0), f"{built} bytes written to build"
    assert written == built, f"{written - built} bytes of frozen weights written by the steps, evaluations or save"


def reference_run(base: Path, validation: Path, probe: torch.Tensor, dora: bool) -> tuple[list[float], torch.Tensor]:
    """The same LoRA fine-tune in plain PyTorch + PEFT, no DeepSpeed: (step losses, logits on `probe` after the last
    step)."""
    losses, model = peft_reference(base, validation, dict(r=RANK, lora_alpha=ALPHA, use_rslora=True, use_dora=dora,
                                                          target_modules=["q_proj", "v_proj", "down_proj"]), STEPS)
    return losses, _logits(model, probe)


def test_the_steps_are_those_of_plain_peft_training(trained: dict[str, Any]) -> None:
    # Only the adapters train, from the same initial A (seeded) and B (zero): the losses are the reference's.
    losses, logits = reference_run(trained["base"], trained["validation"], trained["probe"], trained["dora"])
    assert trained["result"]["losses"] == pytest.approx(losses, rel=1e-4)
    print(f"largest logit difference from the reference: {(logits - trained['logits']).abs().max():.2e}")
    assert torch.allclose(logits, trained["logits"], atol=1e-3, rtol=1e-4), "the last update differs"


def test_the_adapter_loads_with_peft_and_reproduces_the_trained_logits(trained: dict[str, Any]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out: Path = trained["out"]
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "memstrata-run.json",
            "merged"} <= names, names
    assert not list(out.parent.glob(f".{out.name}.partial*")), "the temporary directory was left behind"
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"], config["use_rslora"], config["use_dora"]) == (
        RANK, ALPHA, "LORA", True, trained["dora"])
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "README.md")
    assert (card.data.base_model, card.data.library_name) == (str(trained["base"]), "peft")
    method = "DoRA" if trained["dora"] else "LoRA"
    assert f"{method}, rank {RANK}, alpha {ALPHA:g} (alpha / sqrt(rank), rsLoRA)" in card.text
    assert config["base_model_name_or_path"] == str(trained["base"])
    status = trained["result"]["output"]
    assert status["path"] == str(out) and status["step"] == STEPS

    base = AutoModelForCausalLM.from_pretrained(trained["base"], dtype=torch.float32)
    untrained = _logits(base, trained["probe"])
    model = PeftModel.from_pretrained(base, out)
    logits = _logits(model, trained["probe"])
    assert not torch.allclose(logits, untrained, atol=1e-3), "the adapter changes nothing: it did not train"
    assert torch.allclose(logits, trained["logits"], atol=1e-4, rtol=1e-4), \
        "base + saved adapter does not reproduce the trained engine's logits"


def test_the_merged_model_is_the_base_plus_exactly_the_adapter(trained: dict[str, Any]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out: Path = trained["out"]
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)
    assert torch.allclose(_logits(merged, trained["probe"]), trained["logits"], atol=1e-4, rtol=1e-4), \
        "the merged model does not reproduce the trained engine's logits"
    base = AutoModelForCausalLM.from_pretrained(trained["base"], dtype=torch.float32).state_dict()
    adapter = load_file(out / "adapter_model.safetensors")
    if trained["dora"]:  # PEFT's own merge of the saved adapter, with DoRA's magnitudes, is the merged model
        from peft import PeftModel

        peft_merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
            trained["base"], dtype=torch.float32), out).merge_and_unload().state_dict()
    scaling = ALPHA / math.sqrt(RANK)  # rank-stabilized
    targeted = 0
    for name, weight in merged.state_dict().items():
        module = name.removesuffix(".weight")
        a = adapter.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:
            # Frozen and untargeted: the base's tensor, not a bit changed by training.
            assert torch.equal(weight, base[name]), f"{name} changed although nothing trains it"
            continue
        b = adapter[f"base_model.model.{module}.lora_B.weight"]
        if trained["dora"]:
            m = adapter[f"base_model.model.{module}.lora_magnitude_vector"]
            assert torch.allclose(weight, peft_merged[name], atol=1e-6), name
            assert torch.allclose(weight.norm(dim=1), m, rtol=1e-5), f"{name}: the merged rows' norms are not DoRA's m"
        else:
            assert torch.allclose(weight, base[name] + scaling * b @ a, atol=1e-6), name
        targeted += 1
    assert targeted == 30 * 3  # every layer's q_proj, v_proj and down_proj
