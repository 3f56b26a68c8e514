"""Host-memory arenas placed on chosen NUMA nodes (mmap + mbind).

PyTorch only has a process-wide NUMA policy; memstrata places per tensor:
optimizer operands bound to DRAM nodes, DMA-only data interleaved over CXL
nodes. An arena's placement is set before its pages are touched, then
checked page by page with move_pages (`node_of_pages`).

Works without torch (numpy optional too): the kernel-level checks run in a
minimal guest that has only python3 and numpy.
"""
from __future__ import annotations

import errno as E
from collections.abc import Sequence
from enum import IntEnum
from pathlib import Path
from typing import Any

from memstrata.node.sysfs import parse_list
from memstrata.runtime import _native
from memstrata.runtime.strata.errors import NumaError

__all__ = ["NumaArena", "NumaError", "Policy", "online_nodes", "memory_nodes", "cpu_nodes"]


class Policy(IntEnum):
    BIND = 0  # only these nodes; allocation fails rather than spill
    INTERLEAVE = 1  # pages round-robin over the nodes (DMA-only data over CXL cards)
    PREFERRED = 2  # this node first, spill elsewhere


def _node_list(sysfs_root: str, name: str) -> list[int]:
    path = Path(sysfs_root, "devices/system/node", name)
    try:
        return parse_list(path.read_text())
    except FileNotFoundError:
        return [0]  # kernel built without NUMA: one node
    except (OSError, ValueError) as exc:
        raise NumaError(f"cannot read {path}: {exc}") from exc


def online_nodes(sysfs_root: str = "/sys") -> list[int]:
    return _node_list(sysfs_root, "online")


def memory_nodes(sysfs_root: str = "/sys") -> list[int]:
    """Nodes that have memory (CPU-less CXL nodes included)."""
    return _node_list(sysfs_root, "has_memory")


def cpu_nodes(sysfs_root: str = "/sys") -> list[int]:
    """Nodes that have CPUs: DRAM (CXL expanders show up as CPU-less nodes).
    Every online node where the kernel does not say (no has_cpu)."""
    if not Path(sysfs_root, "devices/system/node/has_cpu").exists():
        return online_nodes(sysfs_root)
    return _node_list(sysfs_root, "has_cpu")


def _validate(nodes: Sequence[int], sysfs_root: str) -> tuple[int, ...]:
    if not nodes:
        raise NumaError("an arena needs at least one NUMA node")
    online, with_memory = online_nodes(sysfs_root), memory_nodes(sysfs_root)
    for node in nodes:
        if node not in online:
            raise NumaError(f"NUMA node {node} does not exist on this machine (online nodes: "
                            f"{','.join(map(str, online))})", nodes=(node,), errno=E.EINVAL)
        if node not in with_memory:
            raise NumaError(f"NUMA node {node} has no memory (nodes with memory: "
                            f"{','.join(map(str, with_memory))})", nodes=(node,), errno=E.EINVAL)
    return tuple(sorted(set(nodes)))


class NumaArena:
    """A page-aligned anonymous mapping with a NUMA policy, viewable without copies."""

    def __init__(self, region: Any, nodes: tuple[int, ...], policy: Policy) -> None:
        self._region = region
        self.nodes = nodes
        self.policy = policy

    @classmethod
    def allocate(cls, nbytes: int, *, nodes: Sequence[int], policy: Policy = Policy.BIND, populate: bool = True,
                 sysfs_root: str = "/sys") -> NumaArena:
        """Map `nbytes` (rounded up to a page), apply `policy` over `nodes`, fault pages in."""
        checked = _validate(nodes, sysfs_root)
        page = _native.PAGE_SIZE
        size = max(page, -(-nbytes // page) * page)
        try:
            region = _native.Region(size)
        except OSError as exc:
            raise NumaError(f"cannot map {size} bytes: {exc.strerror}", nodes=checked, errno=exc.errno) from None
        try:
            region.bind(list(checked), int(policy))
            if populate:
                region.populate()
        except OSError as exc:
            region.close()
            raise NumaError(f"cannot place {size} bytes with policy {policy.name.lower()} on NUMA nodes "
                            f"{','.join(map(str, checked))}: {exc.strerror}", nodes=checked, errno=exc.errno) from None
        return cls(region, checked, policy)

    @property
    def nbytes(self) -> int:
        return int(self._region.size)

    @property
    def address(self) -> int:
        return int(self._region.address)

    def buffer(self) -> memoryview:
        """The arena's bytes as a writable memoryview (no copy)."""
        return memoryview(self._region)

    def numpy(self, dtype: Any = "uint8", count: int = -1, offset: int = 0) -> Any:
        """A numpy array over the arena (no copy)."""
        import numpy as np

        return np.frombuffer(self._region, dtype=dtype, count=count, offset=offset)

    def tensor(self, dtype: Any, count: int = -1, offset: int = 0) -> Any:
        """A 1-D torch tensor over the arena (no copy); torch must already be importable."""
        import torch  # only on request: the arena works without torch

        return torch.frombuffer(self._region, dtype=dtype, count=count, offset=offset)

    def node_of_pages(self, offset: int = 0, length: int | None = None) -> list[int]:
        """The node each page of [offset, offset+length) is on (move_pages); -errno if not present."""
        try:
            return list(self._region.node_of_pages(offset, length or 0))
        except OSError as exc:
            raise NumaError(f"move_pages failed: {exc.strerror}", nodes=self.nodes, errno=exc.errno) from None

    def close(self) -> None:
        """Unmap; refused (BufferError) while a view of it is alive."""
        self._region.close()

    def __enter__(self) -> NumaArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
