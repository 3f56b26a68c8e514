"""The order records are trained in: a held-out split, a bounded shuffle buffer, and endless epochs.

A file is read again for every epoch rather than kept, so memory is bounded by the shuffle buffer, not by
the file. Within an epoch a buffer of `SHUFFLE_BUFFER` records is filled from the stream and a random one is
emitted as each new one comes in (the scheme of tf.data and webdataset): a file that fits in the buffer
is shuffled completely; a larger one is shuffled within a window that slides over it. The random source of
epoch `e` is seeded by (seed, e), so the order is the same for the same seed, and different per epoch.

Which records are held out for validation depends only on (seed, line number), through a hash: the split is
the same in every epoch and every run, and needs no pass over the file to draw.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

__all__ = ["SHUFFLE_BUFFER", "held_out", "shuffled", "epochs"]

SHUFFLE_BUFFER = 10_000  # records; a few MB of short records

T = TypeVar("T")


def held_out(seed: int, fraction: float, salt: str = "") -> Callable[[int], bool]:
    """Whether the record of a key (its line number in a dataset's first file) is a validation record:
    hash(seed, salt, key) < fraction; `salt` tells the datasets of a mix apart."""
    if fraction <= 0:
        return lambda _number: False
    threshold = int(fraction * (1 << 64))

    def test(number: int) -> bool:
        digest = hashlib.blake2b(f"{seed}:{salt}{number}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") < threshold

    return test


def shuffled(items: Iterable[T], size: int, rng: random.Random) -> Iterator[T]:
    """`items` in an order shuffled within a buffer of `size`."""
    buffer: list[T] = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = rng.randrange(size)
        yield buffer[j]
        buffer[j] = item
    rng.shuffle(buffer)
    yield from buffer


def epochs(read: Callable[[], Iterable[T]], seed: int | str, size: int = SHUFFLE_BUFFER) -> Iterator[tuple[int, T]]:
    """(epoch, item) forever: `read()` once per epoch, shuffled by (seed, epoch); it ends at the first epoch
    that reads nothing, which would otherwise be followed by empty epochs for ever at full speed."""
    epoch = 0
    while True:
        rng = random.Random(f"memstrata-data:{seed}:{epoch}")
        empty = True
        for item in shuffled(read(), size, rng):
            empty = False
            yield epoch, item
        if empty:
            return
        epoch += 1
