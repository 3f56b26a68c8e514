"""The ranks of a run deciding about checkpoints together.

Each rank writes its own files of a checkpoint and reads its own back, but what
becomes of a checkpoint is decided once for all of them: whether one is due
(a time-based interval is rank 0's clock), whether it was written (a volume that
refused any rank's write fails it on every rank) and which one a run resumes
from (the newest that every rank finds intact). Every call here is collective:
each rank makes it, in the same order, and leaves it with the same answer, so no
rank waits in a collective another never reaches. Objects travel through
torch.distributed's object collectives, which work on gloo and NCCL alike; a
world of one makes no call at all.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from memstrata.runtime.train.checkpoints import ckptstore
from memstrata.runtime.train.checkpoints.ckptstore import CheckpointError, CheckpointWriteError, Found

__all__ = ["Group", "agree", "outcome"]

T = TypeVar("T")


class Group:
    """The ranks of this run as torch.distributed knows them (one, when it is not initialized)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        self.rank = self.dist.get_rank() if self.dist is not None else 0
        self.world = self.dist.get_world_size() if self.dist is not None else 1

    def gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, by rank, on every rank."""
        if self.dist is None or self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank (what the others pass is ignored)."""
        if self.dist is None or self.world == 1:
            return obj
        box: list[Any] = [obj]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]


def outcome(write: Callable[[], T]) -> tuple[T | None, str | None]:
    """(what `write` returned, None) or (None, why the volume refused it): a refusal is shared with the other
    ranks before anyone raises it, so every rank raises the same error."""
    try:
        return write(), None
    except CheckpointWriteError as exc:
        return None, str(exc)


def _unique(items: list[Any]) -> list[Any]:
    return list(dict.fromkeys(items))


def agree(found: Found, group: Group) -> Found:
    """The checkpoint every rank resumes from: the newest whose manifest and every rank's files are intact.

    Each rank has found the newest checkpoint intact as far as its own files go (ckptstore.find_latest with its
    rank: the ranks hash their own files, in parallel, not rank 0 all of them). The oldest of those is the
    newest any rank can take; a rank that found a newer one checks its own files of it, and while any rank's
    are damaged the next older one is tried. CheckpointError, on every rank, when none is intact for all."""
    if group.world == 1:
        return found
    found_by_rank = group.gather((found.manifest.step, found.skipped, [str(d) for d in found.damaged]))
    skipped = _unique([why for _, s, _ in found_by_rank for why in s])
    damaged = _unique([d for _, _, ds in found_by_rank for d in ds])
    oldest = min(step for step, _, _ in found_by_rank)
    root = found.directory.parent
    # rank 0's listing: every rank tries the same directories in the same order
    candidates = group.broadcast([str(p) for s, p in ckptstore.complete_steps(root) if s <= oldest])
    for directory in map(Path, candidates):
        manifest, error = found.manifest, None
        if directory != found.directory:
            try:
                manifest = ckptstore.verify(directory, group.rank)
            except CheckpointError as exc:
                error = str(exc)
        errors = [e for e in group.gather(error) if e is not None]
        if not errors:
            return Found(directory, manifest, skipped, [Path(d) for d in damaged])
        skipped += _unique(errors)
        damaged.append(str(directory))
    raise CheckpointError(f"{root}: no checkpoint is intact for every rank: " + "; ".join(skipped))
