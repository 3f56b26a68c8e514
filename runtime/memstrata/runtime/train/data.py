"""Training data: built-in synthetic sets and JSONL text files, through a byte-level tokenizer.

Everything is text turned into token ids by `ByteTokenizer` (one token per
UTF-8 byte, plus three specials), so no tokenizer or data set is ever
downloaded. Examples are packed end to end into blocks of `sequence_length + 1`
tokens; a block gives the inputs (all but the last) and the labels (all but the first).

The synthetic sets have structure a small model learns, so a falling loss is
evidence that training works, not noise:

- `arithmetic`: `123+45=168` lines: the format and the digit statistics are
  learnt in a few dozen steps and the loss keeps falling as the model starts
  on the sums (gpt-tiny: 6.2 -> 2.4 in 60 steps, 2.05 after 300).
- `copy`: `abcfe=abcfe` lines over a 16-letter alphabet: the right side is
  fully determined by the left one, but only once the model forms an
  induction head, which takes a 2-layer model many hundred steps; a short
  run learns the alphabet (6.2 -> 2.9) and then plateaus.

Sample `i` depends only on (seed, i), so a run is reproducible and resumable.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal

if TYPE_CHECKING:
    import torch

SyntheticKind = Literal["copy", "arithmetic"]
COPY_ALPHABET = "abcdefghijklmnop"


class DatasetError(ValueError):
    """A dataset file cannot be used; the message names the file (and line) and what is wrong."""


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; then PAD, BOS, EOS."""

    PAD, BOS, EOS = 256, 257, 258
    VOCAB = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def copy_example(rng: random.Random) -> str:
    word = "".join(rng.choice(COPY_ALPHABET) for _ in range(rng.randint(4, 12)))
    return f"{word}={word}\n"


def arithmetic_example(rng: random.Random) -> str:
    a, b = rng.randrange(1000), rng.randrange(1000)
    return f"{a}+{b}={a + b}\n"


EXAMPLES = {"copy": copy_example, "arithmetic": arithmetic_example}


class Blocks:
    """A map-style sequence of (inputs, labels) blocks of `sequence_length` tokens."""

    def __init__(self, sequence_length: int) -> None:
        self.sequence_length = sequence_length

    def block(self, index: int) -> list[int]:
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        import torch  # here, so validating a dataset file needs no torch

        ids = torch.tensor(self.block(index), dtype=torch.long)
        return ids[:-1], ids[1:]

    def batches(self, micro_batch: int, start: int = 0) -> Iterator[tuple["torch.Tensor", "torch.Tensor"]]:
        """Micro-batches forever: blocks start, start+1, ... stacked `micro_batch` at a time."""
        import torch

        index = start
        while True:
            items = [self[index + j] for j in range(micro_batch)]
            index += micro_batch
            yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


class SyntheticBlocks(Blocks):
    """Block `i` is generated from its own RNG seeded by (seed, i): deterministic and unbounded."""

    def __init__(self, kind: SyntheticKind, sequence_length: int, seed: int) -> None:
        super().__init__(sequence_length)
        self.kind, self.seed = kind, seed
        self.tokenizer = ByteTokenizer()

    def block(self, index: int) -> list[int]:
        rng = random.Random(f"{self.kind}:{self.seed}:{index}")
        make = EXAMPLES[self.kind]
        ids = [ByteTokenizer.BOS]
        while len(ids) < self.sequence_length + 1:
            ids += self.tokenizer.encode(make(rng))
        return ids[: self.sequence_length + 1]


class TextBlocks(Blocks):
    """A JSONL corpus, tokenized once and cut into blocks; the order is shuffled per epoch by the seed."""

    def __init__(self, tokens: list[int], sequence_length: int, seed: int) -> None:
        super().__init__(sequence_length)
        span = sequence_length + 1
        self.tokens = tokens
        self.count = len(tokens) // span
        self.seed = seed

    def block(self, index: int) -> list[int]:
        epoch, within = divmod(index, self.count)
        order = list(range(self.count))
        random.Random(f"text:{self.seed}:{epoch}").shuffle(order)
        span = self.sequence_length + 1
        start = order[within] * span
        return self.tokens[start: start + span]


def read_jsonl(path: Path, text_field: str) -> list[str]:
    """The `text_field` of every record; any bad line fails with `file:line: problem`."""
    texts = []
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with handle:
        try:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path}:{number}: malformed JSON: {exc.msg} (column {exc.colno})") from None
                if not isinstance(record, dict):
                    raise DatasetError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
                if text_field not in record:
                    raise DatasetError(f"{path}:{number}: no {text_field!r} field")
                if not isinstance(record[text_field], str):
                    kind = type(record[text_field]).__name__
                    raise DatasetError(f"{path}:{number}: field {text_field!r} must be a string, got {kind}")
                texts.append(record[text_field])
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    return texts


def load_text_blocks(path: Path, text_field: str, sequence_length: int, seed: int) -> TextBlocks:
    tokenizer = ByteTokenizer()
    tokens: list[int] = []
    for text in read_jsonl(path, text_field):
        tokens += [ByteTokenizer.BOS, *tokenizer.encode(text), ByteTokenizer.EOS]
    if len(tokens) < sequence_length + 1:
        raise DatasetError(f"{path}: holds {len(tokens)} tokens, fewer than one training sequence "
                           f"(training.sequenceLength + 1 = {sequence_length + 1})")
    return TextBlocks(tokens, sequence_length, seed)


def build_dataset(synthetic: SyntheticKind | None, path: str | None, text_field: str,
                  sequence_length: int, seed: int) -> Blocks:
    """The blocks a job's `spec.dataset` describes; reads and validates a file dataset completely."""
    if synthetic is not None:
        return SyntheticBlocks(synthetic, sequence_length, seed)
    if path is None:
        raise DatasetError("spec.dataset: set exactly one of dataset.synthetic or dataset.path")
    return load_text_blocks(Path(path), text_field, sequence_length, seed)
