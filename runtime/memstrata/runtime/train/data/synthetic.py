"""Built-in synthetic sets, through the byte tokenizer: structure a small model learns, so a falling loss is
evidence that training works, not noise.

- `arithmetic`: `123+45=168` lines: the format and the digit statistics are learnt in a few dozen steps
  and the loss keeps falling as the model starts on the sums.
- `copy`: `abcfe=abcfe` lines over a 16-letter alphabet: the right side is fully determined by the left
  one, but only once the model forms an induction head, which takes a 2-layer model many hundred steps; a
  short run learns the alphabet and then plateaus.

Block `i` depends only on (seed, i): a run is reproducible, and resuming at any block is free. Every
position is trained on (labels equal the inputs; the model shifts them).
"""
from __future__ import annotations

import random
from typing import Literal

from memstrata.runtime.train.data.tokenizer import ByteTokenizer

__all__ = ["SyntheticKind", "COPY_ALPHABET", "EXAMPLES", "copy_example", "arithmetic_example", "synthetic_block"]

SyntheticKind = Literal["copy", "arithmetic"]
COPY_ALPHABET = "abcdefghijklmnop"


def copy_example(rng: random.Random) -> str:
    word = "".join(rng.choice(COPY_ALPHABET) for _ in range(rng.randint(4, 12)))
    return f"{word}={word}\n"


def arithmetic_example(rng: random.Random) -> str:
    a, b = rng.randrange(1000), rng.randrange(1000)
    return f"{a}+{b}={a + b}\n"


EXAMPLES = {"copy": copy_example, "arithmetic": arithmetic_example}


def synthetic_block(kind: SyntheticKind, seed: int, index: int, length: int, stream: str = "train") -> list[int]:
    """`length` byte tokens of block `index`: BOS, then examples until full. `stream` keys an independent
    sequence of blocks (validation is drawn from its own, so it never repeats a training block)."""
    rng = random.Random(f"{kind}:{seed}:{index}" if stream == "train" else f"{kind}:{stream}:{seed}:{index}")
    make = EXAMPLES[kind]
    tokenizer = ByteTokenizer()
    ids = [ByteTokenizer.BOS]
    while len(ids) < length:
        ids += tokenizer.encode(make(rng))
    return ids[:length]
