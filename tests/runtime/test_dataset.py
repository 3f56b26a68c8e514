"""The training data: deterministic per seed, learnable, and strict about bad JSONL files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")

from memstrata.runtime.train.data import ByteTokenizer, DatasetError, build_dataset, load_text_blocks  # noqa: E402


@pytest.mark.parametrize("kind", ["copy", "arithmetic"])
def test_synthetic_is_deterministic_per_seed(kind: str) -> None:
    a = build_dataset(kind, None, "text", 64, seed=7)
    b = build_dataset(kind, None, "text", 64, seed=7)
    c = build_dataset(kind, None, "text", 64, seed=8)
    assert all(torch.equal(a[i][0], b[i][0]) for i in range(20))
    assert not all(torch.equal(a[i][0], c[i][0]) for i in range(20))
    x, y = a[3]
    assert x.shape == y.shape == (64,)
    assert torch.equal(x[1:], y[:-1]), "labels are the inputs shifted by one token"


def test_copy_lines_repeat_their_left_side() -> None:
    text = ByteTokenizer().decode(build_dataset("copy", None, "text", 512, seed=1).block(0))
    lines = text.split("\n")[:-1]  # the last line is cut by the block boundary
    assert len(lines) > 10
    for line in lines:
        left, right = line.split("=")
        assert left == right and 4 <= len(left) <= 12


def test_arithmetic_lines_are_correct_sums() -> None:
    text = ByteTokenizer().decode(build_dataset("arithmetic", None, "text", 512, seed=1).block(5))
    for line in text.split("\n")[:-1]:
        lhs, total = line.split("=")
        a, b = lhs.split("+")
        assert int(a) + int(b) == int(total)


@pytest.mark.parametrize("kind", ["copy", "arithmetic"])
def test_synthetic_sets_are_learnable(kind: str) -> None:
    """A tiny transformer trained in plain torch (no DeepSpeed) for 40 steps loses >= 30% of its
    loss: the structure is real, not noise a model cannot fit."""
    from memstrata.api.architecture import ModelArchitecture
    from memstrata.runtime.train.model import build_model

    arch = ModelArchitecture(family="gpt", layers=1, hidden=32, intermediate=128, heads=2, kv_heads=2,
                             vocab=ByteTokenizer.VOCAB, tied=True, max_positions=64)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: thread hand-offs cost more than they save, badly so on a busy box
    model = build_model(arch, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = build_dataset(kind, None, "text", 64, seed=3).batches(4)
    losses = []
    for _ in range(40):
        x, y = next(batches)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.set_num_threads(threads)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last <= 0.7 * first, (first, last)


def _jsonl(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_jsonl_blocks_cover_the_text(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, [json.dumps({"text": f"record number {i} " * 3}) for i in range(50)])
    blocks = load_text_blocks(path, "text", 32, seed=0)
    assert blocks.count == len(blocks.tokens) // 33
    assert sorted(blocks.block(i)[0] for i in range(blocks.count)) == sorted(
        blocks.tokens[i * 33] for i in range(blocks.count)), "one epoch visits every block once"
    assert "record number 7" in ByteTokenizer().decode(blocks.tokens)


@pytest.mark.parametrize("line, problem", [
    ('{"text": "ok"', "malformed JSON"),
    ('["text"]', "expected a JSON object, got list"),
    ('{"body": "x"}', "no 'text' field"),
    ('{"text": 5}', "must be a string, got int"),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    path = _jsonl(tmp_path, [json.dumps({"text": "fine " * 40}), "", line])
    with pytest.raises(DatasetError) as err:
        load_text_blocks(path, "text", 16, seed=0)
    assert str(err.value).startswith(f"{path}:3: ") and problem in str(err.value)


def test_too_small_dataset_is_refused(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, [json.dumps({"text": "hi"})])
    with pytest.raises(DatasetError, match="fewer than one training sequence"):
        load_text_blocks(path, "text", 128, seed=0)
