"""Packed examples do not attend to each other: SmolLM2 (real weights) scores every token of an example packed
behind others exactly as it scores the example alone, under each attention implementation Transformers runs on
the CPU; numbering the packed sequence 0..n-1 instead (what a model given no position ids does) does not."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")
pytest.importorskip("transformers", reason="transformers is not installed: run `make install`")

from memstrata.api.finetunejob import Training  # noqa: E402
from memstrata.api.dataset import Dataset  # noqa: E402
from memstrata.runtime.train.data.packing import IGNORE  # noqa: E402
from memstrata.runtime.train.data.pipeline import build_data, load_tokenizer  # noqa: E402

VOCAB = 49152
TEXTS = ["The quick brown fox jumps over the lazy dog near the river bank.",
         "Memory strata: HBM, DRAM, CXL and NVMe, from fastest to largest.",
         "A third example closes the packed sequence with a few more tokens."]


def _token_losses(model, batch, positions) -> torch.Tensor:  # type: ignore[no-untyped-def]
    ids, labels = batch
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
    return torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=IGNORE, reduction="none")


def _alone(data_file: Path, tokenizer, tmp_path: Path) -> list:  # type: ignore[no-untyped-def,type-arg]
    """Each record as a sequence of its own (packing off)."""
    out = []
    for i, line in enumerate(data_file.read_text().splitlines()):
        one = tmp_path / f"one-{i}.jsonl"
        one.write_text(line + "\n")
        out.append(next(build_data(Dataset(path=str(one), packing=False), Training(steps=1, sequence_length=32),
                                   tokenizer).batches(1)))
    return out


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_example_is_scored_as_if_alone(smollm2_dir: Path, tmp_path: Path, attention: str) -> None:
    from transformers import AutoModelForCausalLM

    data_file = tmp_path / "three.jsonl"
    data_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tokenizer = load_tokenizer(smollm2_dir, VOCAB)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32,
                                                 attn_implementation=attention).eval()
    singles = _alone(data_file, tokenizer, tmp_path)
    sizes = [int((s[1][0] != IGNORE).sum()) for s in singles]  # a text record trains on all its tokens
    packed = next(build_data(Dataset(path=str(data_file), packing=True),
                             Training(steps=1, sequence_length=sum(sizes)), tokenizer).batches(1))
    ids, positions = packed[0][0], packed.position_ids
    starts = (positions[0] == 0).nonzero().flatten().tolist()
    assert len(starts) == 3, positions  # one row, the three examples in it, each numbered from 0
    kept = _token_losses(model, packed, positions)
    leaked = _token_losses(model, packed, torch.arange(positions.shape[1]).unsqueeze(0))
    for single, n in zip(singles, sizes):
        at = next(a for a in starts if torch.equal(ids[a: a + n], single[0][0][:n]))
        assert packed[1][0][at] == IGNORE  # scored from the example before it, which it cannot see: no loss
        own = _token_losses(model, single, single.position_ids)[: n - 1]
        assert torch.allclose(kept[at: at + n - 1], own, atol=1e-4), (at, (kept[at: at + n - 1] - own).abs().max())
        if at > 0:  # numbered 0..n-1, a later example sees the ones before it, and its losses change
            assert not torch.allclose(leaked[at: at + n - 1], own, atol=1e-3), at
