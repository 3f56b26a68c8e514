"""Examples into fixed-length sequences, and sequences into micro-batches of `(input_ids, labels)`.

Labels sit at the same positions as the inputs, -100 where there is no loss: a Hugging Face causal LM
shifts them itself (position p's logits are scored against label p + 1). So the label at position 0 of a
sequence is never used, and a sequence whose labels are all -100 past position 0 teaches nothing - worse, a
micro-batch of only such sequences has a 0/0 loss - so those are dropped.

- packing: examples end to end, cut every `length` tokens (an example may span sequences; its mask goes
  with it). Nothing is padded and no token is wasted, at the price of attending across example boundaries,
  which the EOS (or the chat template's turn markers) between them makes harmless in practice.
- no packing: one example per sequence, cut at `length`, right-padded with the pad id (labels -100).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from memstrata.runtime.train.data.encode import Example

if TYPE_CHECKING:
    import torch

__all__ = ["IGNORE", "Row", "labels_of", "trains", "pack", "pad", "sequences", "collate", "micro_batches"]

IGNORE = -100  # the label torch's cross_entropy (and so every Hugging Face model) skips
Row = tuple[list[int], list[int]]  # input ids, labels


def labels_of(example: Example) -> list[int]:
    ids, mask = example
    return [t if m else IGNORE for t, m in zip(ids, mask)]


def trains(labels: list[int]) -> bool:
    """Whether a sequence with these labels contributes to the loss (position 0's label never does)."""
    return any(label != IGNORE for label in labels[1:])


def pack(examples: Iterable[Example], length: int, *, flush_pad: int | None = None) -> Iterator[Row]:
    """Examples concatenated and cut into `length`-token sequences; the last partial one is dropped, or,
    given `flush_pad` (a pad id), padded (for validation, which should lose nothing)."""
    ids: list[int] = []
    labels: list[int] = []
    for example in examples:
        ids += example[0]
        labels += labels_of(example)
        while len(ids) >= length:
            yield ids[:length], labels[:length]
            del ids[:length], labels[:length]
    if flush_pad is not None and ids:
        missing = length - len(ids)
        yield ids + [flush_pad] * missing, labels + [IGNORE] * missing


def pad(examples: Iterable[Example], length: int, pad_id: int) -> Iterator[Row]:
    """One example per sequence, truncated to `length` and right-padded."""
    for example in examples:
        ids, labels = example[0][:length], labels_of(example)[:length]
        missing = length - len(ids)
        yield ids + [pad_id] * missing, labels + [IGNORE] * missing


def sequences(examples: Iterable[Example], length: int, pad_id: int, packing: bool, *,
              flush: bool = False) -> Iterator[Row]:
    """The sequences that train, from `examples` (packed or padded); `flush`: keep a final partial pack."""
    made = (pack(examples, length, flush_pad=pad_id if flush else None) if packing
            else pad(examples, length, pad_id))
    return (s for s in made if trains(s[1]))


def collate(batch: list[Row]) -> tuple["torch.Tensor", "torch.Tensor"]:
    import torch  # here, so validating a dataset needs no torch

    return (torch.tensor([ids for ids, _ in batch], dtype=torch.long),
            torch.tensor([labels for _, labels in batch], dtype=torch.long))


def micro_batches(seqs: Iterable[Row], micro_batch: int, *,
                  keep_last: bool = False) -> Iterator[tuple["torch.Tensor", "torch.Tensor"]]:
    """Sequences stacked `micro_batch` at a time; `keep_last`: a final, smaller batch too."""
    batch: list[Row] = []
    for seq in seqs:
        batch.append(seq)
        if len(batch) == micro_batch:
            yield collate(batch)
            batch = []
    if batch and keep_last:
        yield collate(batch)
