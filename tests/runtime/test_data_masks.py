"""Which tokens are trained on, per record format, with SmolLM2's real tokenizer and chat template; and the
tokenizer checks that run before training."""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")
pytest.importorskip("transformers", reason="transformers is not installed: run `make install`")

from memstrata.api.finetunejob import Training  # noqa: E402
from memstrata.api.dataset import Dataset  # noqa: E402
from memstrata.runtime.train.data.pipeline import DatasetError, HFTokenizer, build_data, load_tokenizer  # noqa: E402
from data_helpers import jsonl as write

VOCAB = 49152  # SmolLM2's config.json


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path) -> HFTokenizer:
    return load_tokenizer(smollm2_dir, VOCAB)



def one_row(path: Path, tokenizer: Any, length: int = 256) -> tuple[list[int], list[int]]:
    """The single padded sequence of a one-record file."""
    data = build_data(Dataset(path=str(path), packing=False), Training(steps=1, sequence_length=length), tokenizer)
    x, y = next(data.batches(1))
    return x[0].tolist(), y[0].tolist()


def labelled_runs(labels: list[int]) -> list[list[int]]:
    """The contiguous runs of labelled positions' token ids."""
    runs: list[list[int]] = []
    previous = False
    for t in labels:
        if t != -100:
            if not previous:
                runs.append([])
            runs[-1].append(t)
        previous = t != -100
    return runs


def test_messages_train_on_assistant_turns_only(tmp_path: Path, smol: HFTokenizer) -> None:
    turns = [{"role": "system", "content": "You answer tersely."},
             {"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "4."},
             {"role": "user", "content": "And 3+3?"},
             {"role": "assistant", "content": "Six, which is 3 doubled."}]
    ids, labels = one_row(write(tmp_path / "chat.jsonl", [{"messages": turns}]), smol)
    text = smol.decode(ids)
    assert text.startswith("<|im_start|>system\nYou answer tersely.<|im_end|>\n<|im_start|>user\nWhat is 2+2?")
    runs = [smol.decode(run) for run in labelled_runs(labels)]
    assert runs == ["4.<|im_end|>", "Six, which is 3 doubled.<|im_end|>"]
    labelled = {i for i, t in enumerate(labels) if t != -100}
    assert all(labels[i] == ids[i] for i in labelled), "labels sit at the inputs' positions (not shifted)"


def test_messages_without_system_get_the_templates_default_unlabelled(tmp_path: Path, smol: HFTokenizer) -> None:
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]
    ids, labels = one_row(write(tmp_path / "chat.jsonl", [{"messages": turns}]), smol)
    assert "You are a helpful AI assistant named SmolLM" in smol.decode(ids)
    assert [smol.decode(run) for run in labelled_runs(labels)] == ["Hello there!<|im_end|>"]


def test_prompt_completion_trains_on_completion_and_eos(tmp_path: Path, smol: HFTokenizer) -> None:
    ids, labels = one_row(write(tmp_path / "pc.jsonl", [{"prompt": "Q: capital of France?\nA:",
                                                         "completion": " Paris"}]), smol)
    assert smol.decode([i for i in ids if i != smol.pad_id]).startswith("Q: capital of France?\nA: Paris")
    assert [smol.decode(run) for run in labelled_runs(labels)] == [" Paris<|im_end|>"]


def test_text_trains_on_every_token_and_eos(tmp_path: Path, smol: HFTokenizer) -> None:
    ids, labels = one_row(write(tmp_path / "t.jsonl", [{"text": "The quick brown fox."}]), smol)
    assert [smol.decode(run) for run in labelled_runs(labels)] == ["The quick brown fox.<|im_end|>"]
    n = len(smol.encode("The quick brown fox.")) + 1
    assert ids[n:] == [smol.pad_id] * (256 - n) and labels[n:] == [-100] * (256 - n), "right padding, no loss"


def tiny_tokenizer(path: Path, chat_template: str | None, vocab_extra: int = 0) -> Path:
    """A word-level tokenizer directory, as another model family would ship one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "</s>", "<pad>", "hi", "hello", "user:", "bot:", "turns"] + [f"w{i}" for i in range(vocab_extra)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="[UNK]")
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(path))
    return path


def test_a_tokenizer_without_chat_template_is_refused_for_messages(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_tokenizer(tmp_path / "model", None), vocab=8)
    data = write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": "hello"}]}])
    with pytest.raises(DatasetError) as err:
        build_data(Dataset(path=str(data)), Training(steps=1, sequence_length=16), tokenizer)
    assert str(err.value).startswith(f"dataset.path {data}: a messages dataset needs a chat template, and the "
                                     f"tokenizer of {tmp_path / 'model'} has none")


def test_a_template_that_is_not_prefix_stable_is_refused(tmp_path: Path) -> None:
    # Starts with the number of turns, so a shorter conversation does not render as a prefix of a longer one.
    template = ("turns {{ messages|length }} {% for m in messages %}{{ 'user:' if m.role == 'user' else 'bot:' }} "
                "{{ m.content }} {% endfor %}{% if add_generation_prompt %}bot: {% endif %}")
    tokenizer = load_tokenizer(tiny_tokenizer(tmp_path / "model", template), vocab=8)
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data = write(tmp_path / "chat.jsonl", [ok, ok])
    with pytest.raises(DatasetError) as err:
        build_data(Dataset(path=str(data)), Training(steps=1, sequence_length=8), tokenizer)
    # Either record may come first in the shuffled order.
    assert re.match(f"{data}:[12]: the chat template of the tokenizer of {tmp_path / 'model'} is not prefix-stable: "
                    r"messages\[:1\] with the generation prompt", str(err.value)), str(err.value)


def test_a_prefix_stable_template_of_another_family_works(tmp_path: Path) -> None:
    template = ("{% for m in messages %}{{ 'user:' if m.role == 'user' else 'bot:' }} {{ m.content }}"
                "{% if m.role == 'assistant' %} </s>{% endif %} {% endfor %}{% if add_generation_prompt %}bot: "
                "{% endif %}")
    tokenizer = load_tokenizer(tiny_tokenizer(tmp_path / "model", template), vocab=8)
    data = write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": "hello"}]}])
    ids, labels = one_row(data, tokenizer, length=8)
    assert ids == [5, 3, 6, 4, 1, 2, 2, 2]  # user: hi bot: hello </s> <pad>...
    assert labels == [-100, -100, -100, 4, 1, -100, -100, -100]


def test_load_tokenizer_names_the_directory(tmp_path: Path, smollm2_dir: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match=f"^{empty}: no tokenizer files"):
        load_tokenizer(empty, VOCAB)
    with pytest.raises(DatasetError, match=f"^{smollm2_dir}: the tokenizer has 49152 tokens but the model's "
                                           "vocabulary has 1000: a tokenizer that does not match the vocab"):
        load_tokenizer(smollm2_dir, 1000)
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(smollm2_dir / "tokenizer_config.json", broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(DatasetError, match=f"^{broken}: the tokenizer does not load"):
        load_tokenizer(broken, VOCAB)
