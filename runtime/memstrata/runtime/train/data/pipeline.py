"""Training data: what a job's `spec.dataset` describes, as micro-batches of `(input_ids, labels)`.

`build_data` is the entry point. A synthetic set is generated block by block through the byte tokenizer;
a JSONL file is validated completely first (one streaming pass, records.py), then streamed for every
epoch through a bounded shuffle buffer (stream.py), each record tokenized with its loss mask (encode.py,
chat.py) and packed or padded into sequences (packing.py). Nothing holds the whole file.

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
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from memstrata.api.finetunejob import Training
from memstrata.api.jobdata import Dataset
from memstrata.runtime.train.data.chat import check_chat_template
from memstrata.runtime.train.data.encode import Example, encode_record
from memstrata.runtime.train.data.packing import Batch, Row, labels_of, micro_batches, row, sequences, trains
from memstrata.runtime.train.data.records import DatasetError, Format, Record, RecordError, read_records, scan
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
    """A JSONL dataset, validated on construction and streamed afterwards."""

    def __init__(self, dataset: Dataset, training: Training, tokenizer: Tokenizer,
                 shuffle_buffer: int = SHUFFLE_BUFFER) -> None:
        assert dataset.path is not None
        self.path, self.text_field = Path(dataset.path), dataset.text_field
        self.tokenizer, self.packing = tokenizer, dataset.packing
        self.length, self.seed, self.shuffle_buffer = training.sequence_length, training.seed, shuffle_buffer
        self.held_out = held_out(training.seed, dataset.validation_split)
        train = scan(self.path, dataset.format, dataset.text_field, keep=lambda n: not self.held_out(n))
        self.format: Format = train.format
        self.why = train.why
        if self.format == "messages":
            check_chat_template(tokenizer, f"dataset.path {self.path}")
        self.train_records = train.kept
        self.validation_records = train.other
        self.stamp = train.stamp  # every epoch's read checks the file is still the one validated
        self.validation_file: Path | None = None
        self.validation_stamp = train.stamp
        self.validation_why = self.why
        if not train.kept:
            raise DatasetError(f"{self.path}: validationSplit {dataset.validation_split} holds out all "
                               f"{train.other} records, leaving none to train on")
        if dataset.validation_split and not train.other:
            raise DatasetError(f"{self.path}: validationSplit {dataset.validation_split} holds out none of the "
                               f"{train.kept} records: raise it, or give a validationPath")
        if dataset.validation_path is not None:
            self.validation_file = Path(dataset.validation_path)
            # Loss on a differently formatted file would not be comparable: the format is the training file's.
            if dataset.format == "auto":
                self.validation_why = f"{self.why} of {self.path}"
            val = scan(self.validation_file, self.format, dataset.text_field, why=self.validation_why)
            if not val.kept:
                raise DatasetError(f"{self.validation_file}: holds no records")
            self.validation_records = val.kept
            self.validation_stamp = val.stamp
        held = (f", {self.validation_records} held out for validation" if dataset.validation_split else
                f"; validation: {self.validation_records} from {self.validation_file}" if self.validation_file
                else "")
        self.summary = f"{self.path}: {self.train_records} {self.format} records{held}"
        self._validation: dict[int, list[Batch]] = {}
        # The first sequence now, so what only tokenizing shows (a chat template that is not prefix-stable,
        # records with nothing to train on within sequenceLength) fails before training starts.
        next(self._train_rows())

    def _encode(self, path: Path, number: int, record: Record) -> Example:
        try:
            return encode_record(record, self.tokenizer)
        except RecordError as exc:
            raise DatasetError(f"{path}:{number}: {exc}") from None

    def _read_train(self) -> Iterator[tuple[int, Record]]:
        return read_records(self.path, self.format, self.text_field, self.why, keep=lambda n: not self.held_out(n),
                            stamp=self.stamp)

    def _train_examples(self) -> Iterator[Example]:
        """Examples forever, epoch after epoch; fails when a whole epoch had nothing to train on, or nothing at
        all (either would otherwise loop forever without yielding a batch)."""
        current, useful = 0, False
        for epoch, (number, record) in epochs(self._read_train, self.seed, self.shuffle_buffer):
            if epoch != current:
                if not useful:
                    raise DatasetError(f"{self.path}: no record has a token to train on within the first "
                                       f"training.sequenceLength ({self.length}) tokens")
                current, useful = epoch, False
            example = self._encode(self.path, number, record)
            if not useful:
                labels = labels_of(example)
                useful = any(m for m in example[1]) if self.packing else trains(labels[: self.length])
            yield example
        raise DatasetError(f"{self.path}: an epoch read no record: the file changed while the run was reading it")

    def _train_rows(self) -> Iterator[Row]:
        return sequences(self._train_examples(), self.length, self.tokenizer.pad_id, self.packing)

    def batches(self, micro_batch: int, start: int = 0, *, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        rank_stride(start, rank, world)  # checks the rank
        rows: Iterator[Row] = itertools.islice(self._train_rows(), start * micro_batch, None)
        if world > 1:  # the other ranks' micro-batches are read past, never made into tensors
            rows = (r for n, r in enumerate(rows) if (n // micro_batch) % world == rank)
        return micro_batches(rows, micro_batch)

    def _validation_examples(self) -> Iterator[Example]:
        if self.validation_file is not None:
            for number, record in read_records(self.validation_file, self.format, self.text_field,
                                               self.validation_why, stamp=self.validation_stamp):
                yield self._encode(self.validation_file, number, record)
        elif self.validation_records:
            for number, record in read_records(self.path, self.format, self.text_field, self.why,
                                               keep=self.held_out, stamp=self.stamp):
                yield self._encode(self.path, number, record)

    def validation(self, micro_batch: int) -> list[Batch]:
        if micro_batch not in self._validation:
            rows = sequences(self._validation_examples(), self.length, self.tokenizer.pad_id, self.packing,
                             flush=True)
            self._validation[micro_batch] = list(micro_batches(rows, micro_batch, keep_last=True))
        return self._validation[micro_batch]


def build_data(dataset: Dataset, training: Training, tokenizer: Tokenizer) -> TrainData:
    """The data a job's `spec.dataset` describes; a file is validated completely (streaming) before this
    returns, so a bad record fails here with `file:line: problem`, before training starts."""
    if dataset.synthetic is not None:
        return SyntheticData(dataset.synthetic, training.sequence_length, training.seed,
                             validation=dataset.validation_split > 0)
    if dataset.path is None:
        raise DatasetError("spec.dataset: set exactly one of dataset.synthetic or dataset.path")
    return FileData(dataset, training, tokenizer)
