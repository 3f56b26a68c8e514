"""Records into micro-batches: packing, padding, the validation split, order by seed, resuming, streaming."""
from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")

from memstrata.api.finetunejob import Training  # noqa: E402
from memstrata.api.dataset import Dataset  # noqa: E402
from memstrata.runtime.train.data.packing import IGNORE  # noqa: E402
from memstrata.runtime.train.data.pipeline import ByteTokenizer, DatasetError, FileData, build_data  # noqa: E402
from memstrata.runtime.train.data.encode import encode_record  # noqa: E402
from memstrata.runtime.train.data.records import PromptCompletion  # noqa: E402
from memstrata.runtime.train.data.stream import epochs  # noqa: E402

BYTES = ByteTokenizer()
BOS, EOS, PAD = ByteTokenizer.BOS, ByteTokenizer.EOS, ByteTokenizer.PAD


def write(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def texts(path: Path, n: int, start: int = 0) -> Path:
    return write(path, [{"text": f"record {i:05d}"} for i in range(start, start + n)])


def rows(data: Any, micro_batch: int, n: int, start: int = 0) -> list[tuple[list[int], list[int]]]:
    """The first `n` micro-batches from `start`, as (ids, labels) lists per sequence."""
    out = []
    batches = data.batches(micro_batch, start)
    for _ in range(n):
        x, y = next(batches)
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (micro_batch, x.shape[1])
        out += list(zip(x.tolist(), y.tolist()))
    return out


def decoded_records(seqs: list[tuple[list[int], list[int]]]) -> list[str]:
    """The text records in unpacked or packed byte sequences (each is BOS text EOS)."""
    stream = [t for ids, _ in seqs for t in ids if t != PAD]
    return [BYTES.decode(chunk) for chunk in _split(stream)]


def _split(stream: list[int]) -> list[list[int]]:
    chunks, current = [], []
    for t in stream:
        if t == BOS:
            current = []
        elif t == EOS:
            chunks.append(current)
        else:
            current.append(t)
    return chunks


def test_packing_concatenates_examples_and_carries_their_masks(tmp_path: Path) -> None:
    records = [{"prompt": f"Question {i}? ", "completion": f"Answer {i}." * (i % 3 + 1)} for i in range(30)]
    path = write(tmp_path / "pc.jsonl", records)
    # A shuffle buffer of one record keeps file order, so the expected stream can be written down.
    data = FileData(Dataset(path=str(path)), Training(steps=1, sequence_length=16), BYTES, shuffle_buffer=1)
    expected_ids: list[int] = []
    expected_labels: list[int] = []
    for r in records:
        ids, mask = encode_record(PromptCompletion(r["prompt"], r["completion"]), BYTES)
        expected_ids += ids
        expected_labels += [t if m else -100 for t, m in zip(ids, mask)]
    seqs = rows(data, 4, 10)
    got_ids = [t for ids, _ in seqs for t in ids]
    got_labels = [t for _, labels in seqs for t in labels]
    assert got_ids == expected_ids[:640] and got_labels == expected_labels[:640]
    assert any(ids[0] != BOS for ids, _ in seqs), "examples span sequence boundaries"
    assert PAD not in got_ids, "packing pads nothing"


def test_without_packing_one_example_per_sequence_right_padded_and_truncated(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [{"text": "short"}, {"text": "x" * 100}])
    data = build_data(Dataset(path=str(path), packing=False), Training(steps=1, sequence_length=24), BYTES)
    seqs = {BYTES.decode(ids)[:5]: (ids, labels) for ids, labels in rows(data, 2, 1)}
    ids, labels = seqs["short"]
    assert ids == [BOS, *b"short", EOS] + [PAD] * 17
    assert labels == [BOS, *b"short", EOS] + [-100] * 17
    ids, labels = seqs["xxxxx"]
    assert ids == labels == [BOS] + [ord("x")] * 23, "cut at sequenceLength, no EOS"


def test_without_packing_a_completion_truncated_away_is_skipped(tmp_path: Path) -> None:
    path = write(tmp_path / "pc.jsonl", [{"prompt": "p" * 50, "completion": "lost"},
                                         {"prompt": "q", "completion": "kept"}])
    data = build_data(Dataset(path=str(path), packing=False), Training(steps=1, sequence_length=16), BYTES)
    for ids, labels in rows(data, 2, 3):
        assert BYTES.decode([t for t in labels if t != -100]) == "kept", "a sequence without loss is dropped"
    only_long = write(tmp_path / "long.jsonl", [{"prompt": "p" * 50, "completion": "lost"}])
    with pytest.raises(DatasetError, match="no record has a token to train on within the first "
                                           r"training.sequenceLength \(16\) tokens"):
        build_data(Dataset(path=str(only_long), packing=False), Training(steps=1, sequence_length=16), BYTES)


def test_a_tiny_file_repeats_to_fill_a_sequence(tmp_path: Path) -> None:
    data = build_data(Dataset(path=str(write(tmp_path / "t.jsonl", [{"text": "hi"}]))),
                      Training(steps=1, sequence_length=64), BYTES)
    (ids, labels), = rows(data, 1, 1)
    assert ids == [BOS, *b"hi", EOS] * 16
    # Packed: no example's first token is scored from the one before it, and each one's positions restart.
    assert labels == [IGNORE, *b"hi", EOS] * 16
    assert next(data.batches(1)).position_ids[0].tolist() == [0, 1, 2, 3] * 16


def test_same_seed_same_batches_other_seed_other_order(tmp_path: Path) -> None:
    path = texts(tmp_path / "t.jsonl", 40)

    def first(seed: int) -> list[Any]:
        data = build_data(Dataset(path=str(path), packing=False), Training(steps=1, sequence_length=16, seed=seed),
                          BYTES)
        return rows(data, 4, 20)  # two epochs

    a, b, c = first(7), first(7), first(8)
    assert a == b
    assert a != c
    epoch0, epoch1 = decoded_records(a[:40]), decoded_records(a[40:])
    assert sorted(epoch0) == sorted(epoch1) == [f"record {i:05d}" for i in range(40)], "each epoch sees every record"
    assert epoch0 != epoch1, "each epoch is shuffled anew"
    assert epoch0 != sorted(epoch0), "shuffled, not file order"


@pytest.mark.parametrize("packing", [True, False])
def test_resume_at_micro_batch_k_gives_what_iterating_to_k_gives(tmp_path: Path, packing: bool) -> None:
    path = texts(tmp_path / "t.jsonl", 25)
    data = build_data(Dataset(path=str(path), packing=packing), Training(steps=1, sequence_length=16), BYTES)
    straight = rows(data, 3, 30)
    for k in (0, 1, 9, 17, 29):
        assert rows(data, 3, 1, start=k) == straight[3 * k: 3 * k + 3]


def test_synthetic_resume_too() -> None:
    data = build_data(Dataset(synthetic="arithmetic"), Training(steps=1, sequence_length=32), BYTES)
    assert rows(data, 2, 1, start=11) == rows(data, 2, 12)[22:]


def test_validation_split_is_reproducible_disjoint_and_sized(tmp_path: Path) -> None:
    path = texts(tmp_path / "t.jsonl", 1000)

    def split(seed: int) -> tuple[Any, list[str]]:
        data = build_data(Dataset(path=str(path), packing=False, validation_split=0.2),
                          Training(steps=1, sequence_length=16, seed=seed), BYTES)
        held = decoded_records([s for x, y in data.validation(8) for s in zip(x.tolist(), y.tolist())])
        return data, held

    data, held = split(3)
    assert split(3)[1] == held
    assert 150 < len(held) < 250 and data.train_records + len(held) == 1000
    trained = decoded_records(rows(data, 10, data.train_records // 10))  # one epoch
    assert not set(trained) & set(held), "no validation record is trained on"
    assert len(set(trained) | set(held)) == 1000
    assert set(split(4)[1]) != set(held), "the split follows the seed"
    assert all(x.shape[0] <= 8 for x, _ in data.validation(8)) and data.validation(8)[0][0].shape == (8, 16)


def test_validation_path_is_read_in_full(tmp_path: Path) -> None:
    train, val = texts(tmp_path / "train.jsonl", 20), texts(tmp_path / "val.jsonl", 5, start=100)
    data = build_data(Dataset(path=str(train), validation_path=str(val)), Training(steps=1, sequence_length=8),
                      BYTES)
    batches = data.validation(4)
    seqs = [s for x, y in batches for s in zip(x.tolist(), y.tolist())]
    assert decoded_records(seqs) == [f"record {i:05d}" for i in range(100, 105)], "in order, none lost"
    assert seqs[-1][1][-1] == -100, "the last packed sequence is padded, without loss on the padding"
    none = build_data(Dataset(path=str(train)), Training(steps=1, sequence_length=8), BYTES)
    assert none.validation(4) == []


def test_a_split_that_leaves_no_side_is_refused(tmp_path: Path) -> None:
    """A one-record file has a record on one side of any split only: every seed is refused, one way or other."""
    one = texts(tmp_path / "one.jsonl", 1)
    messages = set()
    for seed in range(60):
        with pytest.raises(DatasetError) as err:
            build_data(Dataset(path=str(one), validation_split=0.3), Training(steps=1, sequence_length=8, seed=seed),
                       BYTES)
        messages.add(str(err.value))
    assert messages == {f"{one}: validationSplit 0.3 holds out none of the 1 records: raise it, or give a "
                        "validationPath",
                        f"{one}: validationSplit 0.3 holds out all 1 records, leaving none to train on"}


def test_a_large_file_is_streamed_not_held(tmp_path: Path) -> None:
    """100k records: validated completely, and the first batches come while Python's peak memory stays a
    small fraction of what the file's token ids alone would take as a list."""
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(100_000):
            f.write(json.dumps({"text": f"line {i}: the quick brown fox jumps over the lazy dog"}) + "\n")
    tokens = path.stat().st_size - 100_000 * len('{"text": ""}\n') + 100_000 * 2  # bytes + BOS/EOS per record
    tracemalloc.start()
    try:
        data = build_data(Dataset(path=str(path), validation_split=0.01), Training(steps=1, sequence_length=128),
                          BYTES)
        batches = data.batches(4)
        for _ in range(5):
            next(batches)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert data.train_records + data.validation_records == 100_000
    assert peak < tokens * 8 / 4, f"peak {peak / 1e6:.1f} MB for {tokens} tokens"


@pytest.mark.timeout(30)
def test_epochs_end_at_an_epoch_that_reads_nothing() -> None:
    """A source that stops yielding (a file emptied under a run) ends the stream instead of spinning for ever."""
    reads = iter([[1, 2, 3], [4], [], [5]])
    got = list(epochs(lambda: next(reads), seed=0))
    assert sorted(got) == [(0, 1), (0, 2), (0, 3), (1, 4)]
