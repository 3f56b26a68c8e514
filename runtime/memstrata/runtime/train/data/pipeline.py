"""Training data: what a job's `spec.dataset` describes, as micro-batches of `(input_ids, labels)`.

`build_data` is the entry point. A synthetic set is generated block by block through the byte tokenizer;
a dataset's files (sources.py) are validated completely first (one streaming pass, sets.py, records.py), then
streamed for every epoch through a bounded shuffle buffer (stream.py), several datasets drawn by weight, each
record tokenized with its loss mask (encode.py, chat.py) and packed or padded into sequences (packing.py).
Nothing holds a whole file (but a JSON array, which cannot be streamed).

Both produce `(input_ids, labels)` LongTensors of shape (micro_batch, sequence_length), labels at the
inputs' positions with -100 where there is no loss: the model (a Hugging Face causal LM) shifts them.

Resuming: `batches(micro_batch, start=k)` yields what the k-th micro-batch onwards of a fresh iteration
yields. A synthetic set computes block `i` from (seed, i) directly, so that is free. A file replays the
stream: the first k * micro_batch sequences are read and tokenized but never made into tensors, which
costs about as much as tokenizing k * micro_batch * sequence_length tokens - a second or so per
million on one core - cheap for the small sets fine-tuning uses. (A checkpoint of (epoch, file offset,
shuffle buffer, packing remainder) would make it O(1); issue 14.)

Ranks: the data is one sequence of global micro-batches k = 0, 1, 2, ...; rank r of a world of W takes
k = start + j * W + r for its j-th micro-batch (`rank_stride`), so at optimizer step s and accumulation
index a (j = s * GA + a) the W ranks together see what one rank with GA x W accumulation steps would,
and `start` (a checkpoint's micro-batch count) counts global micro-batches. A synthetic set builds only
its own blocks; a file is read whole by every rank and only its own micro-batches are made into tensors.
"""
from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING

from memstrata.api.finetunejob import Training
from memstrata.api.dataset import Dataset, MixSource
from memstrata.runtime.train.data.chat import check_chat_template
from memstrata.runtime.train.data.encode import Example, encode_record
from memstrata.runtime.train.data.packing import Batch, Row, labels_of, micro_batches, row, sequences, trains
from memstrata.runtime.train.data.records import DatasetError, Format, Record, RecordError
from memstrata.runtime.train.data.sets import Counts, DataSet
from memstrata.runtime.train.data.stream import SHUFFLE_BUFFER, epochs, held_out
from memstrata.runtime.train.data.synthetic import SyntheticKind, synthetic_block
from memstrata.runtime.train.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

if TYPE_CHECKING:
    import torch

__all__ = ["DatasetError", "ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer", "TrainData",
           "SyntheticData", "FileData", "build_data", "rank_stride"]

SYNTHETIC_VALIDATION_BLOCKS = 16  # held-out blocks when a synthetic set has a validationSplit


def rank_stride(start: int, rank: int, world: int) -> Iterator[int]:
    """The global micro-batch numbers rank `rank` of `world` trains on, from global micro-batch `start` on."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    return itertools.count(start + rank, world)


class TrainData(ABC):
    """Micro-batches for training (endless) and for validation (finite)."""

    tokenizer: Tokenizer
    summary: str  # one line for the log: what is trained on

    @abstractmethod
    def batches(self, micro_batch: int, start: int = 0, *, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        """Training micro-batches forever, from the `start`-th global one on, this `rank`'s share of a `world`
        (see the module doc on resuming and ranks)."""

    @abstractmethod
    def validation(self, micro_batch: int) -> list[Batch]:
        """The validation micro-batches (the last may be smaller); empty when the dataset has none."""

    def sequences_per_epoch(self) -> int:
        """The training sequences of one pass over the data (training.epochs)."""
        raise DatasetError(f"{self.summary}: endless, it has no epochs: set training.steps")

    def epochs_done(self) -> dict[str, float]:
        """Passes over each dataset the batches taken so far made (records drawn / records); empty: endless."""
        return {}


class SyntheticData(TrainData):
    def __init__(self, kind: SyntheticKind, sequence_length: int, seed: int, validation: bool = False) -> None:
        self.kind, self.sequence_length, self.seed = kind, sequence_length, seed
        self.tokenizer = ByteTokenizer()
        self.has_validation = validation
        self.summary = f"synthetic {kind} (byte tokens)"

    def block(self, index: int) -> list[int]:
        return synthetic_block(self.kind, self.seed, index, self.sequence_length)

    def batches(self, micro_batch: int, start: int = 0, *, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        blocks = (k * micro_batch + i for k in rank_stride(start, rank, world) for i in range(micro_batch))
        rows = (row(ids, list(ids)) for ids in map(self.block, blocks))
        return micro_batches(rows, micro_batch)

    def validation(self, micro_batch: int) -> list[Batch]:
        if not self.has_validation:
            return []
        rows = [row(ids, list(ids)) for ids in (synthetic_block(self.kind, self.seed, i, self.sequence_length,
                                                             stream="validation")
                                             for i in range(SYNTHETIC_VALIDATION_BLOCKS))]
        return list(micro_batches(rows, micro_batch, keep_last=True))


class FileData(TrainData):
    """A dataset (or a weighted mix of several), validated on construction and streamed afterwards."""

    def __init__(self, dataset: Dataset, training: Training, tokenizer: Tokenizer,
                 shuffle_buffer: int = SHUFFLE_BUFFER) -> None:
        self.tokenizer, self.packing, self.completion_only = tokenizer, dataset.packing, dataset.completion_only_loss
        self.length, self.seed, self.shuffle_buffer = training.sequence_length, data_seed(dataset, training), \
            shuffle_buffer
        specs = dataset.sources()
        fields = ["dataset.path"] if dataset.mix is None else [f"dataset.mix[{i}].path" for i in range(len(specs))]
        self.sets = [DataSet(spec, field) for spec, field in zip(specs, fields)]
        self.weights = [spec.weight for spec in specs]
        # The first dataset's split is keyed as a single file's always was (its line numbers), so it is unchanged.
        self.held_out = [held_out(self.seed, dataset.validation_split, salt=f"{i}:" if i else "")
                         for i in range(len(specs))]
        counts = [self._scan(i, dataset.validation_split) for i in range(len(specs))]
        self.format: Format = self.sets[0].format
        for data in self.sets:
            if data.conversation:
                check_chat_template(tokenizer, f"{data.field} {data.name}", data.format)
        if dataset.validation_split and not sum(c.other for c in counts):
            raise DatasetError(f"dataset.mix: validationSplit {dataset.validation_split} holds out none of the "
                               f"{sum(c.kept for c in counts)} records of its sets: raise it")
        self.validation_set: DataSet | None = None
        self.train_records = sum(c.kept for c in counts)
        self.validation_records = sum(c.other for c in counts)
        if dataset.validation_path is not None:
            spec = MixSource(path=dataset.validation_path, weight=1.0, format=dataset.format,
                             text_field=dataset.text_field, columns=dataset.columns)
            self.validation_set = DataSet(spec, "dataset.validationPath", inherit=self.sets[0])
            self.validation_records = self.validation_set.scan().kept
        self.summary = self._summary(counts, dataset)
        self._validation: dict[int, list[Batch]] = {}
        self.counts = counts
        self._per_epoch: int | None = None
        # The first sequence now, so what only tokenizing shows (a chat template that is not prefix-stable,
        # records with nothing to train on within sequenceLength) fails before training starts.
        self.drawn = [0] * len(self.sets)
        next(self._train_rows())
        self.drawn = [0] * len(self.sets)  # records the batches drew, per dataset (epochs_done)

    def _scan(self, i: int, split: float) -> Counts:
        data = self.sets[i]
        counts = data.scan(keep=lambda k: not self.held_out[i](k))
        if not counts.kept:
            raise DatasetError(f"{data.name}: validationSplit {split} holds out all {counts.other} records, leaving "
                               "none to train on")
        if split and not counts.other and len(self.sets) == 1:  # a mix needs held-out records in total only
            raise DatasetError(f"{data.name}: validationSplit {split} holds out none of the {counts.kept} records: "
                               "raise it, or give a validationPath")
        return counts

    def _summary(self, counts: list[Counts], dataset: Dataset) -> str:
        parts = [f"{d.name}: {c.kept} {d.format} records" + (f" (weight {w:g})" if dataset.mix else "")
                 for d, c, w in zip(self.sets, counts, self.weights)]
        held = (f", {self.validation_records} held out for validation" if dataset.validation_split else
                f"; validation: {self.validation_records} from {dataset.validation_path}" if self.validation_set
                else "")
        return "; ".join(parts) + held

    def _encode(self, where: str, record: Record) -> Example:
        try:
            return encode_record(record, self.tokenizer, self.completion_only)
        except RecordError as exc:
            raise DatasetError(f"{where}: {exc}") from None

    def sequences_per_epoch(self) -> int:
        if self._per_epoch is None:
            self._per_epoch = sum(1 for _ in sequences(self._one_pass(), self.length, self.tokenizer.pad_id,
                                                       self.packing, flush=True))
        return self._per_epoch

    def _one_pass(self) -> Iterator[Example]:
        """Every training example once, in file order."""
        for data, test in zip(self.sets, self.held_out):
            for _, where, record in data.records(keep=lambda k: not test(k)):
                yield self._encode(where, record)

    def epochs_done(self) -> dict[str, float]:
        return {data.name: drawn / count.kept for data, drawn, count in zip(self.sets, self.drawn, self.counts)}

    def _set_examples(self, i: int) -> Iterator[Example]:
        """Examples of dataset `i` forever, epoch after epoch; fails when a whole epoch had nothing to train on,
        or nothing at all (either would otherwise loop forever without yielding a batch)."""
        data, test = self.sets[i], self.held_out[i]
        current, useful = 0, False
        seed: int | str = self.seed if i == 0 else f"{self.seed}:{i}"
        for epoch, (_, where, record) in epochs(lambda: data.records(keep=lambda k: not test(k)), seed,
                                                self.shuffle_buffer):
            if epoch != current:
                if not useful:
                    raise DatasetError(f"{data.name}: no record has a token to train on within the first "
                                       f"training.sequenceLength ({self.length}) tokens")
                current, useful = epoch, False
            example = self._encode(where, record)
            self.drawn[i] += 1
            if not useful:
                labels = labels_of(example)
                useful = any(m for m in example[1]) if self.packing else trains(labels[: self.length])
            yield example
        raise DatasetError(f"{data.name}: an epoch read no record: the file changed while the run was reading it")

    def _train_examples(self) -> Iterator[Example]:
        """One dataset's examples, or a mix's: each drawn from dataset i with probability weight_i / sum."""
        streams = [self._set_examples(i) for i in range(len(self.sets))]
        if len(streams) == 1:
            yield from streams[0]
            return
        rng = random.Random(f"memstrata-mix:{self.seed}")
        choices = range(len(streams))
        while True:
            yield next(streams[rng.choices(choices, self.weights)[0]])

    def _train_rows(self) -> Iterator[Row]:
        return sequences(self._train_examples(), self.length, self.tokenizer.pad_id, self.packing)

    def batches(self, micro_batch: int, start: int = 0, *, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        rank_stride(start, rank, world)  # checks the rank
        rows: Iterator[Row] = itertools.islice(self._train_rows(), start * micro_batch, None)
        if world > 1:  # the other ranks' micro-batches are read past, never made into tensors
            rows = (r for n, r in enumerate(rows) if (n // micro_batch) % world == rank)
        return micro_batches(rows, micro_batch)

    def _validation_examples(self) -> Iterator[Example]:
        if self.validation_set is not None:
            for _, where, record in self.validation_set.records():
                yield self._encode(where, record)
            return
        for data, test in zip(self.sets, self.held_out):
            for _, where, record in data.records(keep=test):
                yield self._encode(where, record)

    def validation(self, micro_batch: int) -> list[Batch]:
        if micro_batch not in self._validation:
            rows = sequences(self._validation_examples(), self.length, self.tokenizer.pad_id, self.packing,
                             flush=True)
            self._validation[micro_batch] = list(micro_batches(rows, micro_batch, keep_last=True))
        return self._validation[micro_batch]


def data_seed(dataset: Dataset, training: Training) -> int:
    """The seed of the data's order and split: dataset.seed, else training.seed."""
    return dataset.seed if dataset.seed is not None else training.seed


def build_data(dataset: Dataset, training: Training, tokenizer: Tokenizer) -> TrainData:
    """The data a job's `spec.dataset` describes; a file is validated completely (streaming) before this
    returns, so a bad record fails here with `file:line: problem`, before training starts."""
    if dataset.synthetic is not None:
        return SyntheticData(dataset.synthetic, training.sequence_length, data_seed(dataset, training),
                             validation=dataset.validation_split > 0)
    return FileData(dataset, training, tokenizer)
