"""The synthetic sets: deterministic per seed and learnable. (JSONL files: tests/runtime/test_data_*.py.)"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")

from memstrata.api.finetunejob import Training  # noqa: E402
from memstrata.api.dataset import Dataset  # noqa: E402
from memstrata.runtime.train.data.pipeline import ByteTokenizer, SyntheticData, TrainData, build_data  # noqa: E402


def build_dataset(kind: str, sequence_length: int, seed: int, validation_split: float = 0.0) -> TrainData:
    return build_data(Dataset(synthetic=kind, validation_split=validation_split),
                      Training(steps=1, sequence_length=sequence_length, seed=seed), ByteTokenizer())


@pytest.mark.parametrize("kind", ["copy", "arithmetic"])
def test_synthetic_is_deterministic_per_seed(kind: str) -> None:
    def first(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return next(build_dataset(kind, 64, seed=seed).batches(20))

    (a, la), (b, _), (c, _) = first(7), first(7), first(8)
    assert a.shape == la.shape == (20, 64)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(a, la), "labels sit at the inputs' positions: the model shifts them"


def test_synthetic_validation_is_held_apart() -> None:
    data = build_dataset("arithmetic", 64, seed=1, validation_split=0.1)
    val = data.validation(5)
    assert [x.shape[0] for x, _ in val] == [5, 5, 5, 1]
    train = next(data.batches(64))[0]
    assert not any(torch.equal(v, t) for x, _ in val for v in x for t in train)
    assert build_dataset("arithmetic", 64, seed=1).validation(5) == []


def test_copy_lines_repeat_their_left_side() -> None:
    data = build_dataset("copy", 512, seed=1)
    assert isinstance(data, SyntheticData)
    text = ByteTokenizer().decode(data.block(0))
    lines = text.split("\n")[:-1]  # the last line is cut by the block boundary
    assert len(lines) > 10
    for line in lines:
        left, right = line.split("=")
        assert left == right and 4 <= len(left) <= 12


def test_arithmetic_lines_are_correct_sums() -> None:
    data = build_dataset("arithmetic", 512, seed=1)
    assert isinstance(data, SyntheticData)
    text = ByteTokenizer().decode(data.block(5))
    for line in text.split("\n")[:-1]:
        lhs, total = line.split("=")
        a, b = lhs.split("+")
        assert int(a) + int(b) == int(total)


@pytest.mark.parametrize("kind", ["copy", "arithmetic"])
def test_synthetic_sets_are_learnable(kind: str) -> None:
    """A tiny Hugging Face causal LM (which shifts the labels itself, as in training) trained in plain torch
    (no DeepSpeed) for 40 steps loses >= 30% of its loss: the structure is real, not noise a model cannot fit."""
    transformers = pytest.importorskip("transformers")

    config = transformers.LlamaConfig(vocab_size=ByteTokenizer.VOCAB, hidden_size=32, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: thread hand-offs cost more than they save, badly so on a busy box
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = build_dataset(kind, 64, seed=3).batches(4)
    losses = []
    for _ in range(40):
        x, y = next(batches)
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.set_num_threads(threads)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last <= 0.7 * first, (first, last)
