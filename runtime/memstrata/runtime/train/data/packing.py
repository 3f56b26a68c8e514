"""Examples into fixed-length sequences, and sequences into micro-batches of `(input_ids, labels)`.

Labels sit at the same positions as the inputs, -100 where there is no loss: a Hugging Face causal LM
shifts them itself (position p's logits are scored against label p + 1). So the label at position 0 of a
sequence is never used, and a sequence whose labels are all -100 past position 0 teaches nothing - worse, a
micro-batch of only such sequences has a 0/0 loss - so those are dropped.

- packing: examples end to end, cut every `length` tokens (an example may span sequences; its mask goes
  with it). Nothing is padded and no token is wasted, and no example attends to another: each token's
  position id is its position in its own example, so they restart where an example starts, and the model
  keeps each run of consecutive positions apart (Transformers' masks, sdpa/eager/flex, make the causal mask
  block-diagonal from position ids when no attention mask is given; flash-attention-2 takes them as
  variable-length sequences). A Hugging Face model given no position ids numbers the whole sequence 0..n-1
  and lets every example see the ones before it, which is what TRL and Axolotl avoid too.
- no packing: one example per sequence, cut at `length`, right-padded with the pad id (labels -100); its
  positions run 0..length-1 (the pads after it are masked out of its loss, and causal attention keeps the
  example from seeing them).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from memstrata.runtime.train.data.encode import Example

if TYPE_CHECKING:
    import torch

__all__ = ["IGNORE", "Batch", "Row", "labels_of", "trains", "pack", "pad", "sequences", "collate", "micro_batches"]

IGNORE = -100  # the label torch's cross_entropy (and so every Hugging Face model) skips
Row = tuple[list[int], list[int], list[int]]  # input ids, labels, position ids


class Batch(tuple[Any, ...]):
    """A micro-batch: unpacks as `(input_ids, labels)`; `position_ids` are each token's position in its own
    example (restarting where a packed example starts), what the model keeps packed examples apart by."""

    position_ids: "torch.Tensor"

    def __new__(cls, input_ids: "torch.Tensor", labels: "torch.Tensor", position_ids: "torch.Tensor") -> "Batch":
        batch = super().__new__(cls, (input_ids, labels))
        batch.position_ids = position_ids
        return batch

    @classmethod
    def stacked(cls, batches: list["Batch"]) -> "Batch":
        """`batches`' rows as one batch, in order (layer-major: memstrata.runtime.train.model.layermajor)."""
        import torch

        return cls(*(torch.cat(parts) for parts in zip(*((*b, b.position_ids) for b in batches))))

    def model_inputs(self, device: "torch.device | str") -> dict[str, "torch.Tensor"]:
        """The keyword arguments of a Hugging Face causal LM's forward, on `device`."""
        ids, labels = self
        return {"input_ids": ids.to(device), "labels": labels.to(device), "position_ids": self.position_ids.to(device)}


def row(ids: list[int], labels: list[int]) -> Row:
    """A sequence of one example (or one synthetic block): positions 0..n-1."""
    return ids, labels, list(range(len(ids)))


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
    positions: list[int] = []
    for example in examples:
        ids += example[0]
        # Its first token would be scored from the logits of the example before it, which it cannot see: no loss
        # there, as in a sequence of its own (whose position 0 has none).
        labels += [IGNORE, *labels_of(example)[1:]]
        positions += range(len(example[0]))  # an example cut across sequences goes on counting in the next
        while len(ids) >= length:
            yield ids[:length], labels[:length], positions[:length]
            del ids[:length], labels[:length], positions[:length]
    if flush_pad is not None and ids:
        missing = length - len(ids)
        # The pads continue the last example's positions: after it, so causal attention hides them from it.
        yield (ids + [flush_pad] * missing, labels + [IGNORE] * missing,
               positions + list(range(positions[-1] + 1, positions[-1] + 1 + missing)))


def pad(examples: Iterable[Example], length: int, pad_id: int) -> Iterator[Row]:
    """One example per sequence, truncated to `length` and right-padded."""
    for example in examples:
        ids, labels = example[0][:length], labels_of(example)[:length]
        missing = length - len(ids)
        yield row(ids + [pad_id] * missing, labels + [IGNORE] * missing)


def sequences(examples: Iterable[Example], length: int, pad_id: int, packing: bool, *,
              flush: bool = False) -> Iterator[Row]:
    """The sequences that train, from `examples` (packed or padded); `flush`: keep a final partial pack."""
    made = (pack(examples, length, flush_pad=pad_id if flush else None) if packing
            else pad(examples, length, pad_id))
    return (s for s in made if trains(s[1]))


def collate(batch: list[Row]) -> Batch:
    import torch  # here, so validating a dataset needs no torch

    return Batch(*(torch.tensor([r[k] for r in batch], dtype=torch.long) for k in range(3)))


def micro_batches(seqs: Iterable[Row], micro_batch: int, *, keep_last: bool = False) -> Iterator[Batch]:
    """Sequences stacked `micro_batch` at a time; `keep_last`: a final, smaller batch too."""
    batch: list[Row] = []
    for seq in seqs:
        batch.append(seq)
        if len(batch) == micro_batch:
            yield collate(batch)
            batch = []
    if batch and keep_last:
        yield collate(batch)
