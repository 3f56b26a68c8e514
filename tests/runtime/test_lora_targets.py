"""LoRA settings a model cannot take are refused before anything is built, naming the field: a target module the
model does not have (found on the meta device, from the model's own config), and an adapter of a preset's random
base weights that nothing could ever load."""
from __future__ import annotations

from pathlib import Path

from typing import Any

import pytest

pytest.importorskip("transformers", reason="transformers is not installed: run `make install`")

from memstrata.api.lora import Lora  # noqa: E402
from memstrata.api.architecture import PRESETS  # noqa: E402
from memstrata.runtime.train.model.lora import LoraError, check_target_modules, linear_module_names  # noqa: E402

GOOD = """apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {{name: t}}
spec:
  model: {{preset: gpt-tiny}}
  dataset: {{synthetic: copy}}
  training: {{steps: 2, sequenceLength: 64, method: lora, lora: {lora}}}
  resources: {{gpus: 0}}
  output: {{path: {out}}}
"""

LLAMA = PRESETS["llama3.2-1b"]


def test_a_module_the_model_lacks_is_refused_with_those_it_has() -> None:
    from transformers import Phi3Config

    # Phi-3 plans as a Llama-family model, but fuses Q/K/V and gate/up: neither the default targets nor its own
    # fused modules can be counted, so one message says so (not a module list the next check would refuse).
    config = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=256, pad_token_id=0)
    assert linear_module_names(config) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    for lora in (Lora(), Lora(target_modules=["qkv_proj"])):
        with pytest.raises(LoraError, match=r"^spec\.training\.lora: Phi3Config fuses its projections \(gate_up_proj, "
                                            r"qkv_proj\); .*use training\.method: full for this model$"):
            check_target_modules(config, lora, LLAMA)
    # A Llama has the separate projections: a module it lacks is named with those it has.
    from transformers import LlamaConfig

    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=256)
    with pytest.raises(LoraError, match=r"^spec\.training\.lora\.targetModules: c_attn: the model has no such linear "
                                        r"module \(its linear modules: down_proj, gate_proj, k_proj, o_proj, q_proj, "
                                        r"up_proj, v_proj\)$"):
        check_target_modules(llama, Lora(target_modules=["c_attn"]), LLAMA)
    check_target_modules(llama, Lora(), LLAMA)
    check_target_modules(llama, Lora(target_modules=["all-linear"]), LLAMA)


def test_gpt2s_conv1d_modules_take_adapters() -> None:
    from transformers import GPT2Config

    assert linear_module_names(GPT2Config(n_embd=64, n_layer=2, n_head=4)) == ["c_attn", "c_fc", "c_proj"]


def test_an_adapter_of_a_presets_random_weights_alone_is_refused(cli, tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(GOOD.format(lora="{rank: 4}", out=tmp_path / "out"))
    result = cli("run", str(job), "--nvme-path", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert "spec.training.lora.mergeOnSave: a model.preset's base weights are random and saved nowhere" in \
        result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_all_linear_adapters_are_those_the_planner_counts(family: str, dora: bool) -> None:
    """`targetModules: [all-linear]` on a real transformers model through PEFT: the trainable tensors, in order,
    are exactly the sizes the planner counts (every linear module of every layer, not the LM head; with DoRA each
    module's magnitude vector too, one value per output feature)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from memstrata.api.hfconfig import architecture_from_config
    from memstrata.api.lora import adapter_tensor_sizes
    from memstrata.runtime.train.model.lora import add_adapters

    if family == "llama":
        config: Any = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=256)
        model: Any = LlamaForCausalLM(config)
    else:
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=256)
        model = GPT2LMHeadModel(config)
    arch = architecture_from_config(config.to_dict())
    lora = Lora(rank=4, target_modules=["all-linear"], use_dora=dora)
    peft = add_adapters(model, lora, arch, seed=0)
    magnitudes = [n for n, p in peft.named_parameters() if p.requires_grad and "lora_magnitude_vector" in n]
    assert len(magnitudes) == (len(lora.targets(arch)) + (family == "gpt")) * 2 * dora  # GPT-2: two c_proj
    trained = [p.numel() for p in peft.parameters() if p.requires_grad]
    assert trained == adapter_tensor_sizes(arch, lora)
    assert not any("lm_head" in n for n, p in peft.named_parameters() if p.requires_grad)
