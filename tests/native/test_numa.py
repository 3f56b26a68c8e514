"""NUMA arenas: placement checked page by page with move_pages, views without copies.

This machine has one node, so placement onto a CPU-less CXL node is asserted
in the node-agent issue's QEMU guest; here: node 0 placement, interleave over
every memory node, and a clean refusal of a node that does not exist.
"""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from memstrata.runtime.strata.numa import NumaArena, NumaError, Policy, memory_nodes, online_nodes

MiB = 1 << 20


def test_bound_arena_pages_are_on_the_chosen_node() -> None:
    node = memory_nodes()[0]
    with NumaArena.allocate(8 * MiB + 1, nodes=[node]) as arena:
        placement = arena.node_of_pages()
        assert len(placement) == arena.nbytes // 4096 == 8 * 256 + 1
        assert set(placement) == {node}


def test_interleaved_arena_uses_only_memory_nodes() -> None:
    nodes = memory_nodes()
    with NumaArena.allocate(4 * MiB, nodes=nodes, policy=Policy.INTERLEAVE) as arena:
        assert set(arena.node_of_pages()) <= set(nodes)


def test_untouched_pages_are_reported_absent_not_guessed() -> None:
    with NumaArena.allocate(MiB, nodes=[memory_nodes()[0]], populate=False) as arena:
        assert set(arena.node_of_pages()) == {-errno.ENOENT}
        arena.buffer()[0] = 1
        assert arena.node_of_pages(0, 4096) == [memory_nodes()[0]]


def test_binding_to_a_missing_node_fails_naming_it() -> None:
    missing = max(online_nodes()) + 1
    with pytest.raises(NumaError, match=rf"NUMA node {missing} does not exist on this machine") as info:
        NumaArena.allocate(MiB, nodes=[memory_nodes()[0], missing])
    assert info.value.nodes == (missing,)


def test_views_share_memory_and_pin_the_mapping() -> None:
    arena = NumaArena.allocate(MiB, nodes=[memory_nodes()[0]])
    view = arena.buffer()
    view[:4] = b"\x01\x02\x03\x04"
    with pytest.raises(BufferError, match="views of it are still alive"):
        arena.close()
    np = pytest.importorskip("numpy", reason="numpy views need numpy (the runtime extra has it)")
    a = arena.numpy("uint8", count=4)
    assert a.tolist() == [1, 2, 3, 4]
    a[0] = 9
    assert view[0] == 9
    del a, np
    view.release()
    arena.close()


def test_torch_view_is_zero_copy() -> None:
    torch = pytest.importorskip("torch", reason="torch views need torch (the runtime extra has it)")
    with NumaArena.allocate(MiB, nodes=[memory_nodes()[0]]) as arena:
        t = arena.tensor(torch.float32, count=16)
        t.fill_(2.5)
        assert arena.numpy("float32", count=16).tolist() == [2.5] * 16
        del t


def test_node_lists_are_read_with_the_one_sysfs_parser(tmp_path: Path) -> None:
    nodes = tmp_path / "devices/system/node"
    nodes.mkdir(parents=True)
    (nodes / "online").write_text("0-2,4,7-8\n")
    (nodes / "has_memory").write_text("0-x\n")
    assert online_nodes(str(tmp_path)) == [0, 1, 2, 4, 7, 8]
    with pytest.raises(NumaError, match=r"has_memory: expected a list like 0-3,8 but found '0-x'"):
        memory_nodes(str(tmp_path))
    assert online_nodes(str(tmp_path / "no-numa")) == [0]  # a kernel without NUMA: one node
