"""training.method lora: its settings, what they refuse (naming the field), the CRD's copy of the rules, and the
checkpoint fingerprint that keeps one method's checkpoints from resuming the other's run. (The API server's CEL
rules are exercised in e2e/operator/test_admission.py.)"""
from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from memstrata.api.architecture import PRESETS
from memstrata.api.checkpoint import Identity, identity_mismatches, run_fingerprint
from memstrata.api.crd import generate_crd
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.lora import Lora, adapter_tensor_sizes

BASE: dict[str, Any] = {"model": {"preset": "llama3-8b"}, "dataset": {"synthetic": "copy"},
                        "training": {"steps": 10, "sequenceLength": 64}}


def spec(**training: Any) -> FineTuneJobSpec:
    return FineTuneJobSpec.model_validate({**BASE, "training": {**BASE["training"], **training}})


@pytest.mark.parametrize(("training", "message"), [
    ({"lora": {"rank": 8}}, "training.lora is only for training.method: lora (method is full)"),
    ({"method": "lora", "lora": {"rank": 0}}, "training.lora.rank\n  Input should be greater than 0"),
    ({"method": "lora", "lora": {"alpha": -1}}, "training.lora.alpha\n  Input should be greater than 0"),
    ({"method": "lora", "lora": {"dropout": 1.0}}, "training.lora.dropout\n  Input should be less than 1"),
    ({"method": "lora", "lora": {"targetModules": []}}, "training.lora.targetModules\n  List should have at least 1"),
    ({"method": "lora", "lora": {"targetModules": ["self_attn.q_proj"]}}, "training.lora.targetModules.0\n"),
    ({"method": "lora", "lora": {"targetModules": ["q_proj", "q_proj"]}},
     "training.lora.targetModules: q_proj given twice"),
    ({"method": "lora", "lora": {"targetModules": ["all-linear", "q_proj"]}},
     "training.lora.targetModules: all-linear names every linear module; give it alone (got all-linear, q_proj)"),
    ({"method": "lora", "lora": {"targetModules": ["all-linears"]}}, "training.lora.targetModules.0\n"),
    ({"method": "lora", "lora": {"targetModules": ["c_attn"]}},
     "training.lora.targetModules: c_attn: not a linear module of a Llama-family model's layers (those that take "
     "adapters: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"),
    ({"method": "lora", "lora": {"targetModules": ["lm_head"]}}, "training.lora.targetModules: lm_head: not"),
    ({"method": "qlora"}, "training.method\n  Input should be 'full' or 'lora'"),
    ({"method": "lora", "lora": {"modulesToSave": ["wte"]}}, "training.lora.modulesToSave: wte: not a module memstrata "
     "trains beside LoRA on a Llama-family model (it may name embed_tokens and lm_head)"),
    ({"method": "lora", "lora": {"modulesToSave": ["embed_tokens", "lm_head", "norm"]}},
     "training.lora.modulesToSave\n  List should have at most 2 items"),
])
def test_bad_lora_settings_are_refused_naming_the_field(training: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        spec(**training)
    assert message in str(info.value), str(info.value)


def test_defaults_per_family_and_full_has_no_adapter() -> None:
    assert spec().training.adapter() is None
    lora = spec(method="lora").training.adapter()
    assert lora == Lora() and (lora.rank, lora.alpha, lora.dropout, lora.merge_on_save) == (16, 32.0, 0.05, False)
    llama, gpt = PRESETS["llama3.2-1b"], PRESETS["gpt-tiny"]
    assert lora.targets(llama) == ["q_proj", "v_proj"] and lora.targets(gpt) == ["c_attn"]
    every = Lora(target_modules=["all-linear"])
    assert every.targets(llama) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert every.targets(gpt) == ["c_attn", "c_proj", "c_fc"]


def test_adapter_tensors_are_rank_times_in_plus_out_per_targeted_module() -> None:
    # Llama-3-8B, r 16 on q_proj (4096 -> 4096) and v_proj (4096 -> 1024): per layer 16*(4096+4096) +
    # 16*(4096+1024) = 212,992, x 32 layers = 6,815,744 (the count PEFT prints for this model and config).
    sizes = adapter_tensor_sizes(PRESETS["llama3-8b"], Lora())
    assert sizes[:4] == [16 * 4096, 4096 * 16, 16 * 4096, 1024 * 16] and sum(sizes) == 6_815_744
    # GPT-2's two c_proj modules (attention 768 -> 768, MLP 3072 -> 768) both take adapters.
    gpt = adapter_tensor_sizes(PRESETS["gpt-125m"], Lora(rank=8, target_modules=["c_proj"]))
    assert gpt[:4] == [8 * 768, 768 * 8, 8 * 3072, 768 * 8] and len(gpt) == 4 * 12


def test_dora_adds_one_trained_magnitude_per_output_feature_of_each_targeted_module() -> None:
    # Llama-3-8B, r 16 on q_proj (out 4096) and v_proj (out 1024): 5,120 magnitudes a layer more, after each
    # module's A and B, as PEFT orders its parameters.
    sizes = adapter_tensor_sizes(PRESETS["llama3-8b"], Lora(use_dora=True))
    assert sizes[:6] == [16 * 4096, 4096 * 16, 4096, 16 * 4096, 1024 * 16, 1024]
    assert sum(sizes) == 6_815_744 + 32 * (4096 + 1024)


def test_modules_to_save_train_their_whole_tensors_and_count_once_where_tied() -> None:
    # Llama-3-8B's own head: the embedding before the adapters, the head after them, 128256 x 4096 each.
    llama = PRESETS["llama3-8b"]
    sizes = adapter_tensor_sizes(llama, Lora(modules_to_save=["embed_tokens", "lm_head"]))
    assert sizes[0] == sizes[-1] == 128256 * 4096 and sum(sizes) == 6_815_744 + 2 * 128256 * 4096
    # GPT-2 ties its head to the embedding (wte): one tensor, which both names must name.
    gpt = PRESETS["gpt-125m"]
    tied = adapter_tensor_sizes(gpt, Lora(modules_to_save=["wte", "lm_head"]))
    assert tied[0] == 50304 * 768 and tied[-1] != 50304 * 768
    with pytest.raises(ValueError, match="training.lora.modulesToSave: lm_head: this model's LM head is its input "
                                         "embedding \\(tied\\), so training one trains both: name both"):
        adapter_tensor_sizes(gpt, Lora(modules_to_save=["lm_head"]))


def test_modules_to_save_are_planned_as_trained_base_weights() -> None:
    from memstrata.plan import category_bytes, job_shape

    plain, saved = (job_shape(spec(method="lora", lora=lora)) for lora in ({}, {"modulesToSave": ["embed_tokens",
                                                                                                    "lm_head"]}))
    before, after = category_bytes(plain), category_bytes(saved)
    extra = 2 * 128256 * 4096
    assert after["weights"] == before["weights"]  # weights the model has anyway
    assert after["gradients"] - before["gradients"] == extra * 2  # bf16
    assert after["master"] - before["master"] == extra * 4 and after["optimizer"] - before["optimizer"] == extra * 8


def test_the_crd_carries_the_rules() -> None:
    training = generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["training"]
    rules = {r["message"]: r for r in training["x-kubernetes-validations"]}
    rule = rules["training.lora is only for training.method: lora"]
    assert rule["rule"] == "!has(self.lora) || (has(self.method) && self.method == 'lora')"
    assert rule["fieldPath"] == ".lora"
    assert training["properties"]["method"]["enum"] == ["full", "lora"]
    lora = training["properties"]["lora"]["properties"]
    assert lora["rank"]["minimum"] == 0 and lora["rank"]["exclusiveMinimum"] is True
    assert lora["dropout"]["maximum"] == 1 and lora["dropout"]["exclusiveMaximum"] is True
    assert lora["targetModules"]["x-kubernetes-list-type"] == "set"
    assert lora["targetModules"]["items"]["pattern"] == "^([A-Za-z_][A-Za-z0-9_]*|all-linear)$"


def _identity(training: dict[str, Any]) -> Identity:
    return Identity(memstrata_version="0.1.0", model={}, precision="bf16", world_size=1, sub_groups=[],
                    training=training)


def test_a_checkpoint_of_one_method_never_resumes_the_other() -> None:
    dataset = spec().dataset
    full, lora = run_fingerprint(spec().training, dataset), run_fingerprint(spec(method="lora").training, dataset)
    assert full["training.method"] == "full" and full["training.lora"] is None
    why = identity_mismatches(_identity(full), _identity(lora))
    assert "training.method: the checkpoint has 'full', this job 'lora' (another set of parameters would train" \
        in "\n".join(why), why
    # Another rank is another adapter; mergeOnSave only decides what is written at the end.
    ranked = run_fingerprint(spec(method="lora", lora={"rank": 8}).training, dataset)
    assert [w.split(":")[0] for w in identity_mismatches(_identity(lora), _identity(ranked))] == ["training.lora"]
    merged = run_fingerprint(spec(method="lora", lora={"mergeOnSave": True}).training, dataset)
    assert identity_mismatches(_identity(lora), _identity(merged)) == []
    # DoRA trains magnitudes a LoRA checkpoint does not hold; a LoRA fingerprint is what it was before the field.
    dora = run_fingerprint(spec(method="lora", lora={"useDora": True}).training, dataset)
    assert [w.split(":")[0] for w in identity_mismatches(_identity(lora), _identity(dora))] == ["training.lora"]
    assert "useDora" not in lora["training.lora"] and dora["training.lora"]["useDora"] is True
    # A checkpoint written before the method was recorded was a full fine-tune's.
    old = {k: v for k, v in full.items() if k not in ("training.method", "training.lora")}
    assert identity_mismatches(_identity(old), _identity(full)) == []
    assert identity_mismatches(_identity(old), _identity(lora))
