"""LoRA with `modulesToSave` (PEFT's modules_to_save): a small Qwen2 with its own LM head trains its embedding
and head whole beside the adapters, through memstrata's swap layer. The steps are plain PEFT's with the same
modules_to_save; the adapter it writes carries both modules under PEFT's names, loads with `peft` over the
untouched base model and gives the trained engine's logits, and the merged model does too."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from offload_helpers import peft_reference, run_lora_job

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install`")
pytest.importorskip("peft", reason="peft is not installed: run `make install`")

STEPS, SAVED = 3, ["embed_tokens", "lm_head"]

pytestmark = pytest.mark.usefixtures("deepspeed_ready")


def _base(tmp: Path, smollm2_dir: Path, tied: bool = False) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         tie_word_embeddings=tied)
    torch.manual_seed(0)
    path = tmp / f"qwen2-small{'-tied' if tied else ''}"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, path / name)
    return path


def _train(tmp: Path, smollm2_dir: Path, tied: bool) -> dict[str, Any]:
    lora = f"rank: 4, alpha: 8, targetModules: [q_proj, v_proj], dropout: 0.0, modulesToSave: {SAVED}, mergeOnSave: true"
    return run_lora_job(tmp, _base(tmp, smollm2_dir, tied), lora, STEPS)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Any]:
    return _train(tmp_path_factory.mktemp("saved"), smollm2_dir, tied=False)


def _logits(model: Any, probe: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=probe).logits.float()


def test_the_embedding_and_head_train_as_with_peft(trained: dict[str, Any]) -> None:
    # PEFT trains copies of the two modules (its ModulesToSaveWrapper); memstrata the modules themselves.
    losses, _ = peft_reference(trained["base"], trained["validation"],
                               dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=SAVED), STEPS)
    assert trained["result"]["losses"] == pytest.approx(losses, rel=1e-4)


def test_the_adapter_carries_both_modules_and_loads_with_peft(trained: dict[str, Any]) -> None:
    _loads_with_peft(trained)


def test_a_tied_head_trains_as_the_embedding_and_both_load_with_peft(tmp_path: Path, smollm2_dir: Path) -> None:
    """One tensor, saved under both names: PEFT's two copies load the same trained values."""
    _loads_with_peft(_train(tmp_path, smollm2_dir, tied=True))


def _loads_with_peft(trained: dict[str, Any]) -> None:
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = trained["out"]
    assert json.loads((out / "adapter_config.json").read_text())["modules_to_save"] == SAVED
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"} <= keys
    base = AutoModelForCausalLM.from_pretrained(trained["base"], dtype=torch.float32)
    untouched = base.get_input_embeddings().weight.detach().clone()
    loaded = PeftModel.from_pretrained(base, str(out))
    assert not torch.equal(loaded.get_input_embeddings().weight, untouched), "the embedding did not train"
    assert torch.allclose(_logits(loaded, trained["probe"]), trained["logits"], atol=1e-4)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)
    assert torch.allclose(_logits(merged, trained["probe"]), trained["logits"], atol=1e-4)
