"""Several datasets mixed by weight, and large files streamed: which set each example comes from, that every set
runs through its own epochs, that a resumed stream continues exactly, and that memory does not grow with the file."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

torch = pytest.importorskip("torch", reason="torch is not installed: run `make install` (the runtime extra)")
datasets = pytest.importorskip("datasets", reason="datasets is not installed: run `make install`")

from memstrata.api.dataset import Dataset  # noqa: E402
from memstrata.api.finetunejob import Training  # noqa: E402
from memstrata.runtime.train.data.pipeline import ByteTokenizer, DatasetError, build_data  # noqa: E402
from data_helpers import jsonl

BYTES = ByteTokenizer()



def two_sets(tmp: Path, a: int = 50, b: int = 50) -> tuple[Path, Path]:
    return (jsonl(tmp / "a.jsonl", [{"text": f"a{i:03d} " + "a" * 16} for i in range(a)]),
            jsonl(tmp / "b.jsonl", [{"text": f"b{i:03d} " + "b" * 16} for i in range(b)]))


def mixed(a: Path, b: Path, wa: float, wb: float, seed: int = 0, **dataset: Any) -> Any:
    spec = Dataset(mix=[{"path": str(a), "weight": wa}, {"path": str(b), "weight": wb}], packing=False, **dataset)
    return build_data(spec, Training(steps=1, sequence_length=32, seed=seed), BYTES)


def texts(data: Any, n: int, start: int = 0) -> list[str]:
    batches = data.batches(1, start=start)
    return [BYTES.decode(next(batches)[0][0].tolist()).split(" ")[0] for _ in range(n)]


def test_examples_are_drawn_by_weight_and_the_order_is_the_seeds(tmp_path: Path) -> None:
    a, b = two_sets(tmp_path)
    drawn = texts(mixed(a, b, 3, 1), 400)
    share = sum(t.startswith("a") for t in drawn) / len(drawn)
    assert 0.69 <= share <= 0.81, share  # 0.75 within three standard deviations of 400 draws
    assert drawn == texts(mixed(a, b, 3, 1), 400)
    assert drawn != texts(mixed(a, b, 3, 1, seed=1), 400)


def test_each_set_runs_through_its_own_epochs(tmp_path: Path) -> None:
    """A 5-record set repeats many times while a 100-record one, drawn as often, has not repeated a record."""
    a, b = two_sets(tmp_path, a=5, b=100)
    drawn = texts(mixed(a, b, 1, 1), 120)
    from_a = [t for t in drawn if t.startswith("a")]
    from_b = [t for t in drawn if t.startswith("b")]
    assert len(set(from_a)) == 5 and len(from_a) > 30
    assert len(from_b) == len(set(from_b)) and len(from_b) > 30


def test_a_resumed_mix_continues_exactly(tmp_path: Path) -> None:
    a, b = two_sets(tmp_path, a=7, b=30)
    whole = texts(mixed(a, b, 2, 1), 80)
    assert texts(mixed(a, b, 2, 1), 43, start=37) == whole[37:]


def test_validation_holds_out_records_of_every_set(tmp_path: Path) -> None:
    a, b = two_sets(tmp_path, a=100, b=100)
    data = mixed(a, b, 1, 1, validation_split=0.2)
    held = {BYTES.decode(x.tolist()).split(" ")[0] for xs, _ in data.validation(4) for x in xs}
    assert any(t.startswith("a") for t in held) and any(t.startswith("b") for t in held)
    assert not held & set(texts(data, 300))
    assert data.train_records + data.validation_records == 200


def test_a_bad_record_in_a_mixed_set_names_its_file_and_field(tmp_path: Path) -> None:
    a, _ = two_sets(tmp_path)
    odd = jsonl(tmp_path / "odd.jsonl", [{"body": "no known field"}])
    with pytest.raises(DatasetError) as err:
        mixed(a, odd, 1, 1)
    assert str(err.value).startswith(f"{odd}:1: no 'text', 'prompt'/'completion'"), err.value
    assert "set dataset.mix[1].format, textField or columns" in str(err.value)


@pytest.mark.parametrize("spec, problem", [
    ({"path": "/d.jsonl", "mix": [{"path": "/a", "weight": 1}, {"path": "/b", "weight": 1}]},
     "set exactly one of dataset.synthetic, dataset.path or dataset.mix"),
    ({"mix": [{"path": "/a", "weight": 1}]}, "at least 2 items"),
    ({"mix": [{"path": "/a", "weight": 1}, {"path": "/b", "weight": 0}]}, "greater than 0"),
    ({"mix": [{"path": "/a", "weight": 1}, {"path": "/b", "weight": 1}], "validationPath": "/v"},
     "dataset.mix takes its validation records from each set by validationSplit"),
    ({"mix": [{"path": "/a", "weight": 1}, {"path": "/b", "weight": 1}], "format": "alpaca"},
     r"dataset.format: with dataset.mix, give each set's own in dataset.mix\[i\]"),
])
def test_bad_mixes_are_refused(spec: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        Dataset.model_validate(spec)


SCRIPT = textwrap.dedent("""
    import json, sys, tracemalloc
    import pyarrow, torch  # loaded before measuring: the libraries are not the data
    from memstrata.api.dataset import Dataset
    from memstrata.api.finetunejob import Training
    from memstrata.runtime.train.data.pipeline import ByteTokenizer, build_data

    tracemalloc.start()
    data = build_data(Dataset(path=sys.argv[1]), Training(steps=1, sequence_length=64), ByteTokenizer())
    batches = data.batches(8)
    for _ in range(50):
        next(batches)
    held = tracemalloc.get_traced_memory()[1] + pyarrow.default_memory_pool().max_memory()
    print(json.dumps({"records": data.train_records, "held_mib": held / 2**20}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["big.jsonl.gz", "big.parquet"])
def test_a_large_file_is_streamed_in_bounded_memory(tmp_path: Path, name: str) -> None:
    """150k records (about 45 MiB as text, several times that as Python objects) are validated and trained from
    while the data held at any time (Python's heap at its peak, and pyarrow's pool at its peak) stays under a
    third of the text's size: the shuffle buffer and a batch of rows, never the file."""
    import gzip

    records = [{"text": f"record {i} " + "lorem ipsum dolor sit amet " * 11} for i in range(150_000)]
    size_mib = sum(len(r["text"]) for r in records) / 2**20
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wt", compresslevel=1) as out:
            out.writelines(json.dumps(r) + "\n" for r in records)
    else:
        datasets.Dataset.from_list(records).to_parquet(str(path))
    del records
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["records"] == 150_000
    assert result["held_mib"] < size_mib / 3, (result, size_mib)


def test_the_data_seed_moves_the_order_and_split_but_not_the_model_seed(tmp_path: Path) -> None:
    """dataset.seed decides the order and the held-out records; without it training.seed does."""
    a, _ = two_sets(tmp_path, a=200)

    def order(**kw: Any) -> tuple[list[str], set[str]]:
        spec = Dataset(path=str(a), packing=False, validation_split=0.2, **kw.pop("dataset", {}))
        data = build_data(spec, Training(steps=1, sequence_length=32, **kw), BYTES)
        held = {BYTES.decode(x.tolist()).split(" ")[0] for xs, _ in data.validation(4) for x in xs}
        return texts(data, 30), held

    base = order(seed=1)
    assert order(seed=2, dataset={"seed": 1}) == base  # the model seed alone does not move the data
    moved = order(seed=1, dataset={"seed": 9})
    assert moved[0] != base[0] and moved[1] != base[1]


def test_a_small_set_of_a_mix_may_hold_out_nothing(tmp_path: Path) -> None:
    """The split is drawn per record: a one-record set holds none out, and the mix still validates on the rest."""
    a, b = two_sets(tmp_path, a=1, b=100)
    data = mixed(a, b, 1, 1, validation_split=0.2)
    assert data.train_records >= 1 and data.validation_records > 0
