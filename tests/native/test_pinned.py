"""The exact-size pinned arena: layout, real mlock accounting, and the RLIMIT_MEMLOCK error."""
from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import textwrap

import pytest
from native_helpers import child_env

from memstrata.runtime.strata.pinned import (
    ALIGN, BufferSet, PinnedArena, PinnedMemoryError, ShapeClass, buffer_sets_for, layout, locked_bytes_total,
    shape_class, vm_locked_bytes,
)

GPT2_SMALL = {
    "transformer.wte.weight": 50304 * 768,
    "lm_head.weight": 50304 * 768,
    "transformer.h.0.attn.c_attn.weight": 768 * 2304,
    "transformer.h.0.attn.c_proj.weight": 768 * 768,
    "transformer.h.0.mlp.c_fc.weight": 768 * 3072,
    "transformer.h.0.mlp.c_proj.weight": 3072 * 768,
    "transformer.h.0.ln_1.weight": 768,
    "transformer.h.0.attn.c_attn.bias": 2304,
}


def test_shape_classes_and_per_class_sizes() -> None:
    assert shape_class("model.layers.3.self_attn.q_proj.weight") is ShapeClass.ATTENTION
    assert shape_class("model.layers.3.mlp.down_proj.weight") is ShapeClass.MLP
    assert shape_class("model.embed_tokens.weight") is ShapeClass.EMBEDDING
    assert shape_class("model.layers.3.input_layernorm.weight") is ShapeClass.OTHER
    sets = {s.shape_class: s for s in buffer_sets_for(GPT2_SMALL, dtype_bytes=2, count=2)}
    assert sets[ShapeClass.EMBEDDING].buffer_bytes == 50304 * 768 * 2
    assert sets[ShapeClass.ATTENTION].buffer_bytes == 768 * 2304 * 2
    assert sets[ShapeClass.MLP].buffer_bytes == 768 * 3072 * 2
    assert sets[ShapeClass.OTHER].buffer_bytes == 2304 * 2
    # Never more buffers than a class has tensors: 8 asked, 2 embedding tensors (wte, lm_head) -> 2.
    capped = {s.shape_class: s.count for s in buffer_sets_for(GPT2_SMALL, dtype_bytes=2, count=8)}
    assert capped == {ShapeClass.EMBEDDING: 2, ShapeClass.ATTENTION: 2, ShapeClass.MLP: 2, ShapeClass.OTHER: 2}


def test_memstratas_own_head_and_positions_are_embedding_sized() -> None:
    assert shape_class("head.weight") is ShapeClass.EMBEDDING
    assert shape_class("positions.weight") is ShapeClass.EMBEDDING
    assert shape_class("blocks.0.attn.q.weight") is ShapeClass.ATTENTION
    assert shape_class("blocks.0.mlp.gate.weight") is ShapeClass.MLP


def test_layout_is_exact_to_4k_with_no_power_of_two_rounding() -> None:
    slots, total = layout([BufferSet(ShapeClass.MLP, 5000, 3), BufferSet(ShapeClass.ATTENTION, 12289, 1)])
    assert [off for _, off, _ in slots] == [0, 8192, 16384, 24576]
    assert total == 3 * 8192 + 16384 and all(off % ALIGN == 0 for _, off, _ in slots)
    # torch's pinned allocator would take 3 * 8192 + 16384 -> each rounded to 2**k: same here only by chance
    _, big = layout([BufferSet(ShapeClass.EMBEDDING, 77_260_800, 1)])
    assert big == 77_262_848 and big < 2**27


def test_arena_really_locks_its_bytes_and_unlocks_on_close() -> None:
    before, accounted = vm_locked_bytes(), locked_bytes_total()
    arena = PinnedArena.create([BufferSet(ShapeClass.MLP, 3 * 2**20 + 5, 2), BufferSet(ShapeClass.OTHER, 100, 1)])
    size = 2 * (3 * 2**20 + 4096) + 4096
    assert arena.nbytes == arena.locked_bytes == size and not arena.cuda_registered
    assert vm_locked_bytes() - before == size and locked_bytes_total() - accounted == size
    a = arena.acquire(ShapeClass.MLP)
    b = arena.acquire(ShapeClass.MLP, 10)
    assert len(a) == 3 * 2**20 + 5 and len(b) == 10
    with pytest.raises(PinnedMemoryError, match="all buffers of shape class 'mlp' are in use"):
        arena.acquire(ShapeClass.MLP)
    arena.release(a)
    arena.release(b)
    with pytest.raises(ValueError, match="released twice"):
        arena.release(arena.buffer()[:10])
    arena.close()
    assert vm_locked_bytes() == before and locked_bytes_total() == accounted


LOW_LIMIT_CHILD = textwrap.dedent("""
    from memstrata.runtime.strata.pinned import BufferSet, PinnedArena, PinnedMemoryError, ShapeClass
    small = PinnedArena.create([BufferSet(ShapeClass.OTHER, 256 * 1024, 1)])  # fits under the limit
    try:
        PinnedArena.create([BufferSet(ShapeClass.MLP, 16 << 20, 1)])
    except PinnedMemoryError as e:
        print(e.needed_bytes, e.limit_bytes, e, sep="\\n")
    else:
        print("locked despite the limit")
""")


def _drop_ipc_lock_and_limit() -> None:
    # Root ignores RLIMIT_MEMLOCK through CAP_IPC_LOCK: drop it from the
    # bounding set so the exec'd child is capped like an unprivileged pod.
    PR_CAPBSET_DROP, CAP_IPC_LOCK = 24, 14
    if os.geteuid() == 0 and ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK)")
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))


def test_low_memlock_limit_gives_a_clear_error_with_the_number_needed() -> None:
    proc = subprocess.run([sys.executable, "-c", LOW_LIMIT_CHILD], capture_output=True, text=True, timeout=60,
                          env=child_env(), preexec_fn=_drop_ipc_lock_and_limit)
    assert proc.returncode == 0, proc.stderr
    needed, limit, message = proc.stdout.splitlines()[:3]
    assert int(limit) == 1 << 20
    assert int(needed) == 256 * 1024 + (16 << 20)  # what is already locked + this arena
    assert f"RLIMIT_MEMLOCK is {1 << 20} bytes" in message and f"at least {needed} bytes" in message
