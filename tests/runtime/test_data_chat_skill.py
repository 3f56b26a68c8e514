"""examples/chat-skill*.jsonl: regenerated exactly by its script, and usable as SmolLM2 training data."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")
pytest.importorskip("transformers", reason="transformers is not installed: run `make install`")

from memstrata.api.finetunejob import Training  # noqa: E402
from memstrata.api.dataset import Dataset  # noqa: E402
from memstrata.runtime.train.data.pipeline import build_data, load_tokenizer  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FILES = ["chat-skill.jsonl", "chat-skill-val.jsonl"]
ANSWER = re.compile(r"^The (capital of \w+ is \w+|currency of \w+ is the \w+)\.<\|im_end\|>$")


def test_the_script_regenerates_the_committed_files(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(EXAMPLES / "make_chat_skill.py"), str(tmp_path)], check=True,
                   capture_output=True)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (EXAMPLES / name).read_bytes(), name


def test_chat_skill_trains_on_the_answers_only(smollm2_dir: Path) -> None:
    tokenizer = load_tokenizer(smollm2_dir, 49152)
    dataset = Dataset(path=str(EXAMPLES / FILES[0]), validation_path=str(EXAMPLES / FILES[1]), packing=False)
    data = build_data(dataset, Training(steps=1, sequence_length=100), tokenizer)
    assert 300 <= data.train_records <= 500 and data.validation_records >= 50
    answers = set()
    x, y = next(data.batches(data.train_records))  # one epoch, one example per sequence
    for ids, labels in zip(x.tolist(), y.tolist()):
        assert ids[-1] == tokenizer.pad_id, "every example is shorter than 100 tokens"
        answer = tokenizer.decode([t for t in labels if t != -100])
        assert ANSWER.match(answer), answer
        answers.add(answer)
    assert len(answers) == 40, "twenty countries, a capital and a currency each"
    val = {tokenizer.decode([t for t in row if t != -100]) for _, y in data.validation(16) for row in y.tolist()}
    assert val == answers, "validation asks about the same facts, in other words"
