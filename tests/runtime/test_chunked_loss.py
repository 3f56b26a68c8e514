"""The chunked loss is Hugging Face's loss, without ever holding the sequence x vocabulary logits."""
from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from memstrata.runtime.train.model.loss import IGNORE_INDEX, chunked_cross_entropy, install_chunked_loss

VOCAB, SEQ = 1000, 96


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4, use_cache=False)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :30] = IGNORE_INDEX  # a masked prompt, as chat data has
    return ids, labels


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, dict]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama-tied", "gpt2"])
@pytest.mark.parametrize("chunk", [1, 17, 4096])
def test_same_loss_and_gradients_as_hugging_face(build, chunk: int) -> None:
    ids, labels = _batch()
    stock = build()
    want_loss, want_grads = _loss_and_grads(stock, ids, labels)
    ours = build()
    install_chunked_loss(ours, chunk)
    got_loss, got_grads = _loss_and_grads(ours, ids, labels)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_no_tensor_of_the_whole_logits_is_kept_for_backward() -> None:
    """What autograd keeps between forward and backward: with chunks of 16 tokens no saved tensor has more
    than 16 x vocab elements; Hugging Face's loss keeps the whole (b·s) x vocab."""
    ids, labels = _batch()
    whole = ids.numel() * VOCAB

    def largest_saved(model: torch.nn.Module) -> int:
        sizes: list[int] = [0]
        weights = {p.data_ptr() for p in model.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dim() and t.shape[-1] == VOCAB and t.data_ptr() not in weights:  # logits, not the head
                sizes.append(t.numel())
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=labels).loss.backward()
        return max(sizes)

    assert largest_saved(_llama()) >= whole - 2 * VOCAB  # the shifted logits: b·(s-1) x vocab
    ours = _llama()
    install_chunked_loss(ours, 16)
    assert largest_saved(ours) <= 16 * VOCAB


def test_without_labels_the_model_still_gives_logits() -> None:
    ids, _ = _batch()
    stock, ours = _llama(), _llama()
    install_chunked_loss(ours, 8)
    torch.testing.assert_close(ours(input_ids=ids).logits, stock(input_ids=ids).logits)


def test_nothing_scored_is_zero_not_nan() -> None:
    hidden = torch.randn(1, 5, 4, requires_grad=True)
    loss = chunked_cross_entropy(hidden, torch.randn(10, 4), None, torch.full((1, 5), IGNORE_INDEX), 2)
    assert float(loss.detach()) == 0.0


def test_a_head_that_is_not_a_plain_linear_layer_is_refused() -> None:
    model = _llama()
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(ValueError, match=r"spec.training.lossChunkTokens: .*Sequential.*lossChunkTokens: 0"):
        install_chunked_loss(model, 8)


def test_logits_are_made_a_chunk_at_a_time_in_forward_and_again_in_backward(monkeypatch) -> None:
    from memstrata.runtime.train.model import loss as loss_module

    rows: list[int] = []
    real = loss_module._chunk_sum

    def counting(hidden, weight, bias, labels):
        rows.append(hidden.shape[0])
        return real(hidden, weight, bias, labels)

    monkeypatch.setattr(loss_module, "_chunk_sum", counting)
    ids, labels = _batch()
    model = _llama()
    install_chunked_loss(model, 16)
    model(input_ids=ids, labels=labels).loss.backward()
    chunks = -(-2 * (SEQ - 1) // 16)
    assert len(rows) == 2 * chunks  # each chunk once in forward, once recomputed in backward
    assert max(rows) == 16 and sum(rows) == 2 * 2 * (SEQ - 1)


def test_models_whose_own_loss_is_more_than_the_heads_are_refused() -> None:
    from transformers import CohereConfig, GPT2Config, GraniteConfig, LlamaConfig, MixtralConfig

    from memstrata.runtime.train.model.loss import chunked_loss_refusal

    assert chunked_loss_refusal(LlamaConfig()) is None
    assert chunked_loss_refusal(GPT2Config()) is None
    assert chunked_loss_refusal(GraniteConfig(logits_scaling=1.0)) is None
    assert chunked_loss_refusal(MixtralConfig()) is None  # no router loss unless asked for
    assert "logits_scaling=8.0" in chunked_loss_refusal(GraniteConfig(logits_scaling=8.0))
    assert "logit_scale=0.0625" in chunked_loss_refusal(CohereConfig())
    assert "output_router_logits=True" in chunked_loss_refusal(MixtralConfig(output_router_logits=True))


GRANITE_JOB = """apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {{name: t}}
spec:
  model: {{path: {model}}}
  dataset: {{synthetic: copy}}
  training: {{steps: 1, sequenceLength: 32{chunk}}}
  resources: {{gpus: 0}}
"""


def test_a_set_chunk_on_such_a_model_fails_before_training_naming_the_field(cli, tmp_path) -> None:
    from transformers import GraniteConfig

    torch.manual_seed(0)
    config = GraniteConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, logits_scaling=8.0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "granite")
    job = tmp_path / "job.yaml"
    job.write_text(GRANITE_JOB.format(model=tmp_path / "granite", chunk=", lossChunkTokens: 16"))
    result = cli("run", str(job), "--nvme-path", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert ("spec.training.lossChunkTokens: GraniteConfig changes its logits or its loss beyond the LM head "
            "(logits_scaling=8.0)") in result.stderr
    assert "set lossChunkTokens: 0" in result.stderr
