"""Datasets as users have them: every file format and preset, read with SmolLM2's real tokenizer, and the tokens
trained on checked one by one against what SmolLM2's chat template renders."""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")
pytest.importorskip("transformers", reason="transformers is not installed: run `make install`")
datasets = pytest.importorskip("datasets", reason="datasets is not installed: run `make install`")

from memstrata.api.dataset import Dataset  # noqa: E402
from memstrata.api.finetunejob import Training  # noqa: E402
from memstrata.runtime.train.data.pipeline import DatasetError, HFTokenizer, build_data, load_tokenizer  # noqa: E402
from memstrata.runtime.train.data.tokenizer import use_chat_template  # noqa: E402
from data_helpers import jsonl

VOCAB = 49152  # SmolLM2's config.json
END = "<|im_end|>"
SYSTEM, QUESTION, ANSWER = "You answer tersely.", "What is 2+2?", "4, since 2 and 2 make 4."
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Six."}]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> HFTokenizer:
    return load_tokenizer(smollm2_dir, VOCAB)



def one_row(tokenizer: Any, **dataset: Any) -> tuple[list[int], list[int]]:
    """The single padded sequence of a one-record dataset."""
    data = build_data(Dataset(packing=False, **dataset), Training(steps=1, sequence_length=256), tokenizer)
    x, y = next(data.batches(1))
    return x[0].tolist(), y[0].tolist()


def trained_runs(tokenizer: HFTokenizer, labels: list[int]) -> list[str]:
    """The text of each contiguous run of trained positions."""
    runs: list[list[int]] = []
    previous = False
    for t in labels:
        if t != -100:
            runs.append([t]) if not previous else runs[-1].append(t)
        previous = t != -100
    return [tokenizer.decode(run) for run in runs]


def check_against_template(tokenizer: HFTokenizer, ids: list[int], labels: list[int], turns: list[dict[str, Any]],
                           trained: list[str]) -> None:
    """The sequence is the template's rendering, token for token, and exactly the `trained` answers (each through
    its end-of-turn token) carry labels, at their own positions."""
    text = tokenizer.hf.apply_chat_template(turns, tokenize=False)
    rendered = list(tokenizer.hf(text, add_special_tokens=False)["input_ids"])  # as apply_chat_template tokenizes
    assert ids[: len(rendered)] == rendered
    assert all(t == tokenizer.pad_id for t in ids[len(rendered):])
    assert all(label in (-100, token) for label, token in zip(labels, ids))
    assert trained_runs(tokenizer, labels) == [answer + END for answer in trained]


def test_sharegpt_gzipped_jsonl(tmp_path: Path, smol: HFTokenizer) -> None:
    record = {"id": "x1", "conversations": [{"from": SHAREGPT_ROLE[t["role"]], "value": t["content"]} for t in CHAT]}
    path = tmp_path / "sharegpt.jsonl.gz"
    path.write_bytes(gzip.compress((json.dumps(record) + "\n").encode()))
    ids, labels = one_row(smol, path=str(path))
    check_against_template(smol, ids, labels, CHAT, [ANSWER, "Six."])


def test_alpaca_json_array(tmp_path: Path, smol: HFTokenizer) -> None:
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps([{"instruction": "Add the numbers.", "input": "2 and 2", "output": ANSWER}], indent=2))
    ids, labels = one_row(smol, path=str(path))
    turns = [{"role": "user", "content": "Add the numbers.\n\n2 and 2"}, {"role": "assistant", "content": ANSWER}]
    check_against_template(smol, ids, labels, turns, [ANSWER])


def test_alpaca_with_renamed_columns_and_a_system_prompt(tmp_path: Path, smol: HFTokenizer) -> None:
    path = jsonl(tmp_path / "qa.jsonl", [{"question": QUESTION, "answer": ANSWER, "persona": SYSTEM}])
    ids, labels = one_row(smol, path=str(path), format="alpaca",
                          columns={"instruction": "question", "output": "answer", "system": "persona"})
    check_against_template(smol, ids, labels, CHAT[:3], [ANSWER])


def test_trl_conversational_prompt_completion_in_parquet(tmp_path: Path, smol: HFTokenizer) -> None:
    """TRL's conversational prompt/completion: the loss is on the completion only, so the prompt's own (few-shot)
    assistant turn is context, not trained on."""
    path = tmp_path / "trl.parquet"
    datasets.Dataset.from_list([{"prompt": CHAT[:4], "completion": CHAT[4:]}]).to_parquet(str(path))
    ids, labels = one_row(smol, path=str(path))
    check_against_template(smol, ids, labels, CHAT, ["Six."])


def test_a_save_to_disk_directory_reads_its_train_split(tmp_path: Path, smol: HFTokenizer) -> None:
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"messages": CHAT}]),
                                   "test": datasets.Dataset.from_list([{"messages": CHAT[:3]}])})
    splits.save_to_disk(str(tmp_path / "saved"))
    ids, labels = one_row(smol, path=str(tmp_path / "saved"))
    check_against_template(smol, ids, labels, CHAT, [ANSWER, "Six."])
    only_test = datasets.DatasetDict({"test": splits["test"]})
    only_test.save_to_disk(str(tmp_path / "no-train"))
    with pytest.raises(DatasetError, match=r"no-train: a saved DatasetDict without a train split \(it has test\)"):
        one_row(smol, path=str(tmp_path / "no-train"))


def test_several_files_by_directory_and_by_glob(tmp_path: Path, smol: HFTokenizer) -> None:
    """A directory's data files (nested ones too, hidden ones not) and a glob are read in sorted order."""
    (tmp_path / "d" / "more").mkdir(parents=True)
    jsonl(tmp_path / "d" / "a.jsonl", [{"text": "first file"}])
    jsonl(tmp_path / "d" / "more" / "b.jsonl", [{"text": "second file"}])
    jsonl(tmp_path / "d" / ".hidden.jsonl", [{"text": "never read"}])
    (tmp_path / "d" / "README.md").write_text("not data")
    for path in (tmp_path / "d", tmp_path / "d" / "**" / "*.jsonl"):
        data = build_data(Dataset(path=str(path)), Training(steps=1, sequence_length=256, seed=0), smol)
        assert data.train_records == 2, path
        assert "never read" not in smol.decode(next(data.batches(1))[0][0].tolist())


def test_tool_turns_need_a_template_that_renders_the_calls(tmp_path: Path, smol: HFTokenizer) -> None:
    """SmolLM2's template writes a `tool` turn but drops `tool_calls`: the record is refused rather than trained
    without its call; with a chatTemplate that renders calls, the call and the final answer are trained on and
    the tool's output is not."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    turns = [CHAT[1], {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "content": "4", "tool_call_id": "c1"}, {"role": "assistant", "content": ANSWER}]
    path = jsonl(tmp_path / "tools.jsonl", [{"messages": turns}])
    with pytest.raises(DatasetError, match=r"tools.jsonl:1: messages\[1\] has tool_calls, but the chat template of "
                                           r".* does not render them"):
        one_row(smol, path=str(path))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
                "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}({{ c.function.arguments | tojson }})"
                "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    tokenizer = load_tokenizer(Path(smol.hf.name_or_path), VOCAB)
    use_chat_template(tokenizer, template)
    ids, labels = one_row(tokenizer, path=str(path))
    assert trained_runs(tokenizer, labels) == ['<tool_call>add({"a": 2, "b": 2})</tool_call>' + END, ANSWER + END]
    assert "<|im_start|>tool\n4<|im_end|>" in tokenizer.decode(ids)


def test_a_chat_template_that_cannot_render_is_refused_naming_the_field(smol: HFTokenizer) -> None:
    tokenizer = load_tokenizer(Path(smol.hf.name_or_path), VOCAB)
    with pytest.raises(DatasetError, match=r"dataset.chatTemplate: does not render a user/assistant exchange"):
        use_chat_template(tokenizer, "{% for m in messages %}{{ m.content }")
    with pytest.raises(DatasetError, match=r"dataset.chatTemplate: a user/assistant exchange renders without"):
        use_chat_template(tokenizer, "{% for m in messages %}{{ m.role }}{% endfor %}")


@pytest.mark.parametrize("records, problem", [
    ([{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]}],
     "conversations[1]: unknown role 'bot' (expected one of human, user, gpt, assistant"),
    ([{"conversations": [{"from": "human", "value": "hi"}]}], "no assistant turn in field 'conversations'"),
    ([{"instruction": "x", "output": 3}], "field 'output' must be a string, got int"),
    ([{"prompt": [{"role": "user", "content": "hi"}], "completion": "yo"}],
     "fields 'prompt' and 'completion' must both be strings or both lists of messages"),
    ([{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "user", "content": "yo"}]}],
     "no assistant turn in the completion"),
])
def test_bad_preset_records_name_the_file_and_line(tmp_path: Path, smol: HFTokenizer, records: list[Any],
                                                   problem: str) -> None:
    path = jsonl(tmp_path / "data.jsonl", [{"text": "fine"}] * 0 + records)
    with pytest.raises(DatasetError) as err:
        one_row(smol, path=str(path))
    assert str(err.value).startswith(f"{path}:1: "), err.value
    assert problem in str(err.value), err.value


def test_a_bad_parquet_row_is_named_by_row(tmp_path: Path, smol: HFTokenizer) -> None:
    path = tmp_path / "data.parquet"
    rows = [{"prompt": "p", "completion": "c"}] * 4 + [{"prompt": "p", "completion": None}]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    with pytest.raises(DatasetError) as err:
        one_row(smol, path=str(path))
    assert str(err.value) == f"{path}:row 5: field 'completion' must be a string, got NoneType"


@pytest.mark.parametrize("make, problem", [
    (lambda d: d / "none-*.jsonl", "matches no file"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "a directory with no data files"),
    (lambda d: (d / "x.parquet").write_text("not parquet") and d / "x.parquet", "cannot be read as parquet"),
    (lambda d: d / "missing.parquet", "cannot read: No such file or directory"),
])
def test_paths_that_name_no_data_are_refused(tmp_path: Path, smol: HFTokenizer, make: Any, problem: str) -> None:
    path = make(tmp_path)
    with pytest.raises(DatasetError) as err:
        one_row(smol, path=str(path))
    assert str(err.value).startswith(f"{path}: {problem}"), err.value


def _every_format(tmp: Path, chats: list[list[dict[str, str]]]) -> list[dict[str, Any]]:
    """The same conversations written in each format a user brings, one dataset per format."""
    def sharegpt(c: list[dict[str, str]]) -> dict[str, Any]:
        return {"conversations": [{"from": SHAREGPT_ROLE[t["role"]], "value": t["content"]} for t in c]}

    jsonl(tmp / "messages.jsonl", [{"messages": c} for c in chats])
    (tmp / "sharegpt.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(sharegpt(c)) + "\n"
                                                                  for c in chats).encode()))
    (tmp / "alpaca.json").write_text(json.dumps([{"instruction": c[-2]["content"], "input": "",
                                                  "output": c[-1]["content"]} for c in chats]))
    datasets.Dataset.from_list([{"prompt": c[:-1], "completion": c[-1:]} for c in chats]).to_parquet(
        str(tmp / "trl.parquet"))
    datasets.Dataset.from_list([{"text": c[-1]["content"]} for c in chats]).save_to_disk(str(tmp / "saved"))
    names = ["messages.jsonl", "sharegpt.jsonl.gz", "alpaca.json", "trl.parquet", "saved"]
    return [{"path": str(tmp / name), "weight": weight} for name, weight in zip(names, [2, 1, 1, 1, 0.5])]


@pytest.mark.slow
def test_smollm2_trains_on_a_mix_of_every_format(tmp_path: Path, smollm2_dir: Path, cli: Any, repo: Path) -> None:
    """`memstrata run` on SmolLM2 with five datasets, one per format, mixed by weight: every set is validated and
    named in the run's summary, three steps train, and the model is written."""
    chats = [json.loads(line)["messages"] for line in (repo / "examples/chat-skill.jsonl").read_text().splitlines()]
    mix = _every_format(tmp_path, chats[:24])
    job = {"apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "formats"},
           "spec": {"model": {"path": str(smollm2_dir)}, "dataset": {"mix": mix, "validationSplit": 0.2},
                    "training": {"sequenceLength": 128, "microBatch": 2, "steps": 3, "learningRate": 1e-4,
                                 "precision": "fp32", "seed": 7},
                    "resources": {"gpus": 0}, "memory": {"engine": "deepspeed"},
                    "output": {"path": str(tmp_path / "out")}}}
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    (tmp_path / "nvme").mkdir()
    proc = cli("run", str(tmp_path / "job.yaml"), "--nvme-path", str(tmp_path / "nvme"), "--report-json",
               str(tmp_path / "report.json"), timeout=900, env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = "".join((proc.stdout + proc.stderr).split())  # the progress display wraps long lines, even in words
    for source, fmt in zip(mix, ["messages", "sharegpt", "alpaca", "prompt_completion", "text"]):
        assert re.search(rf"{re.escape(source['path'])}:\d+{fmt}records\(weight{source['weight']:g}\)", said), said
    losses = [json.loads(line)["loss"] for line in (tmp_path / "out-metrics" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses), losses
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
def test_compressed_json_lines_read_as_the_plain_file(tmp_path: Path, smol: HFTokenizer, suffix: str) -> None:
    import fsspec

    records = [{"prompt": f"Q{i}: ", "completion": f"answer {i}"} for i in range(3)]
    plain = jsonl(tmp_path / "plain.jsonl", records)
    packed = tmp_path / f"data.jsonl{suffix}"
    with fsspec.open(str(packed), "wb", compression="infer") as out:
        out.write(plain.read_bytes())
    assert packed.read_bytes()[:16] != plain.read_bytes()[:16]
    training = Training(steps=1, sequence_length=64, seed=3)
    expect, got = (next(build_data(Dataset(path=str(p)), training, smol).batches(3)) for p in (plain, packed))
    assert all(torch.equal(a, b) for a, b in zip(expect, got))


def test_csv_cells_are_text_as_written(tmp_path: Path, smol: HFTokenizer) -> None:
    """A CSV's numbers stay the text the file holds ("1.50", not 1.5), and a quoted cell keeps its newline."""
    path = tmp_path / "qa.csv"
    path.write_text('prompt,completion\n"Price of tea?\nAnswer:", 1.50\n')
    ids, labels = one_row(smol, path=str(path))
    assert trained_runs(smol, labels) == [" 1.50" + smol.hf.eos_token]
    assert smol.decode(ids).startswith("Price of tea?\nAnswer: 1.50")


def test_loss_on_the_whole_conversation_when_completion_only_loss_is_off(tmp_path: Path, smol: HFTokenizer) -> None:
    """completionOnlyLoss: false trains on every token the template renders: system, user turns and markers."""
    path = jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    ids, labels = one_row(smol, path=str(path), completion_only_loss=False)
    text = smol.hf.apply_chat_template(CHAT, tokenize=False)
    n = len(smol.hf(text, add_special_tokens=False)["input_ids"])
    assert labels[:n] == ids[:n] and set(labels[n:]) == {-100}
    _, only = one_row(smol, path=str(path))
    assert sum(t != -100 for t in only) < n / 2
