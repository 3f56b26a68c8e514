"""Dataset files are validated before training: every bad record fails with `file:line: problem`."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")

from memstrata.api.finetunejob import Training  # noqa: E402
from memstrata.api.dataset import Dataset  # noqa: E402
from memstrata.runtime.train.data.pipeline import ByteTokenizer, DatasetError, build_data  # noqa: E402
from data_helpers import jsonl as write

TRAINING = Training(steps=1, sequence_length=32, micro_batch=2)
GOOD = {
    "text": {"text": "a fine line of text"},
    "prompt_completion": {"prompt": "Q: 1+1? A:", "completion": " 2"},
    "messages": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
}



def build(path: Path, tokenizer: Any = None, **dataset: Any) -> Any:
    return build_data(Dataset(path=str(path), **dataset), TRAINING, tokenizer or ByteTokenizer())


def error_of(path: Path, tokenizer: Any = None, **dataset: Any) -> str:
    with pytest.raises(DatasetError) as err:
        build(path, tokenizer, **dataset)
    return str(err.value)


@pytest.mark.parametrize("fmt, line, problem", [
    ("text", '{"text": "ok"', "malformed JSON"),
    ("text", '["text"]', "expected a JSON object, got list"),
    ("text", {"body": "x"}, "no 'text' field"),
    ("text", {"text": 5}, "field 'text' must be a string, got int"),
    ("prompt_completion", {"prompt": "p"}, "no 'completion' field"),
    ("prompt_completion", {"prompt": "p", "completion": None}, "field 'completion' must be a string, got NoneType"),
    ("messages", {"messages": []}, "field 'messages' is empty"),
    ("messages", {"messages": "hi"}, "field 'messages' must be a list, got str"),
    ("messages", {"messages": ["hi"]}, "messages[0] must be an object, got str"),
    ("messages", {"messages": [{"role": "user"}]}, "no 'content' field in messages[0]"),
    ("messages", {"messages": [{"role": "user", "content": 3}]}, "field 'content' in messages[0] must be a string"),
    ("messages", {"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]},
     "messages[1]: unknown role 'robot' (expected one of system, user, assistant, tool)"),
    ("messages", {"messages": [{"content": "x"}]}, "no 'role' field in messages[0]"),
    ("messages", {"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    ("messages", {"messages": [{"role": "assistant", "content": "x"}]}, "messages[0] is an assistant turn"),
    ("text", GOOD["messages"], "a messages record, but the dataset's format is text (that of line 1)"),
    ("messages", GOOD["prompt_completion"],
     "a prompt_completion record, but the dataset's format is messages (that of line 1)"),
])
def test_bad_record_names_file_and_line(tmp_path: Path, fmt: str, line: Any, problem: str) -> None:
    # Line 2 is blank (skipped, but counted), so the bad record is on line 4.
    path = write(tmp_path / "data.jsonl", [GOOD[fmt], "", GOOD[fmt], line, GOOD[fmt]])
    message = error_of(path)
    assert message.startswith(f"{path}:4: "), message
    assert problem in message, message


def test_a_bad_record_after_the_first_batch_still_fails_before_training(tmp_path: Path) -> None:
    """The whole file is checked up front, not only what the first batches read."""
    path = write(tmp_path / "data.jsonl", [{"text": "x" * 100}] * 5000 + [{"text": 1}])
    assert error_of(path).startswith(f"{path}:5001: field 'text' must be a string")


def test_explicit_format_overrides_the_first_record(tmp_path: Path) -> None:
    path = write(tmp_path / "data.jsonl", [GOOD["text"]])
    assert error_of(path, format="prompt_completion") == (
        f"{path}:1: a text record, but the dataset's format is prompt_completion (set by dataset.format)")


def test_text_field_names_the_field(tmp_path: Path) -> None:
    path = write(tmp_path / "data.jsonl", [{"body": "hello world " * 10}] * 3)
    assert build(path, text_field="body").format == "text"
    assert "no 'text', 'prompt'/'completion', 'messages', ShareGPT" in error_of(path)


def test_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "\xff"}\n')
    assert error_of(path).startswith(f"{path}:2: not UTF-8 text")


def test_missing_and_empty_files(tmp_path: Path) -> None:
    assert error_of(tmp_path / "nope.jsonl").startswith(f"{tmp_path / 'nope.jsonl'}: cannot read")
    assert error_of(write(tmp_path / "empty.jsonl", ["", " "])) == f"{tmp_path / 'empty.jsonl'}: holds no records"


def test_messages_need_a_chat_template(tmp_path: Path) -> None:
    path = write(tmp_path / "chat.jsonl", [GOOD["messages"]])
    message = error_of(path)
    assert message.startswith(f"dataset.path {path}: a messages dataset needs a chat template, "
                              "and the byte tokenizer has none"), message


def test_validation_file_is_checked_too(tmp_path: Path) -> None:
    train = write(tmp_path / "train.jsonl", [GOOD["text"]] * 4)
    val = write(tmp_path / "val.jsonl", [GOOD["text"], GOOD["prompt_completion"]])
    assert error_of(train, validation_path=str(val)) == (
        f"{val}:2: a prompt_completion record, but the dataset's format is text (that of line 1 of {train})")
    empty = write(tmp_path / "empty.jsonl", [""])
    assert error_of(train, validation_path=str(empty)) == f"{empty}: holds no records"


@pytest.mark.timeout(60)  # before the fix an emptied file spun the epoch loop for ever
@pytest.mark.parametrize("change", ["emptied", "rewritten"])
def test_a_file_that_changes_mid_run_fails_naming_it(tmp_path: Path, change: str) -> None:
    """`: > ds.jsonl` (or an edit) while a run streams the file: the next read fails naming it, never loops."""
    path = write(tmp_path / "data.jsonl", [{"text": f"record {i} " + "words " * 15} for i in range(20)])
    batches = build(path).batches(2)
    for _ in range(5):
        next(batches)
    if change == "emptied":
        path.write_bytes(b"")
    else:
        write(path, [{"text": f"other {i} " + "words " * 15} for i in range(21)])
    with pytest.raises(DatasetError) as err:
        for _ in range(10_000):  # several epochs' worth: the change must show within one
            next(batches)
    message = str(err.value)
    assert message.startswith(f"{path}: changed while the run was reading it"), message
    assert ("now 0 bytes" if change == "emptied" else "now 2") in message, message
