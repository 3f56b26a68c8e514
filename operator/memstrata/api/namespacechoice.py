"""Which free NVMe namespaces a job gets: one rule, used by the planner and by the device plugin.

The planner sizes the NVMe stratum from the namespaces it picks; the kubelet grants
whichever namespace IDs it likes unless the device plugin answers
GetPreferredAllocation. Both call `choose_namespaces`, so a pod is granted the
namespaces its plan counted whenever the kubelet still has them free.

The rule: largest first, so that striping (bounded by the smallest member) gets the
most capacity; equal sizes by name, so the choice is the same on every call.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["NamespaceCandidate", "choose_namespaces"]


@dataclass(frozen=True)
class NamespaceCandidate:
    id: str  # what the caller gets back: the planner uses the name, the device plugin its device ID
    name: str  # the block device's name (nvme0n1): the tie-break
    size_bytes: int


def _rank(c: NamespaceCandidate) -> tuple[int, str]:
    return (-c.size_bytes, c.name)


def choose_namespaces(candidates: Iterable[NamespaceCandidate], count: int,
                      must_include: Sequence[str] = ()) -> list[str]:
    """The IDs of `count` namespaces: every ID of `must_include` first (the kubelet's already-granted ones,
    never dropped), then the best of the other candidates by the rule. Fewer when fewer candidates exist."""
    if count < 0:
        raise ValueError(f"namespace count must be >= 0, got {count}")
    chosen = list(dict.fromkeys(must_include))
    rest = sorted((c for c in candidates if c.id not in chosen), key=_rank)
    return chosen + [c.id for c in rest[: max(count - len(chosen), 0)]]
