"""The host heap every run gets (memstrata.runtime.swap.hostheap): big blocks in their own mappings, and torch's
CPU blocks of 2 MiB or more advised huge pages, which takes back the page faults those mappings cost each step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from native_helpers import unavailable

from memstrata.runtime.swap.hostheap import THP_SETTING, advised_huge, thp_mode, thp_offered

# /proc/self/smaps as Linux 6.x prints it: the probe's block (advised: `hg`) and a heap mapping (not).
SMAPS = """\
7f3a40000000-7f3a40401000 rw-p 00000000 00:00 0
Size:               4100 kB
AnonHugePages:      4096 kB
THPeligible:        1
VmFlags: rd wr mr mw me ac sd hg
55d0c8a4d000-55d0c8b6e000 rw-p 00000000 00:00 0                          [heap]
Size:               1156 kB
THPeligible:        0
VmFlags: rd wr mr mw me ac sd
"""


def test_the_mapping_holding_an_address_says_whether_it_is_advised_huge_pages() -> None:
    assert advised_huge(SMAPS, 0x7F3A40000000) is True
    assert advised_huge(SMAPS, 0x7F3A40400FFF) is True
    assert advised_huge(SMAPS, 0x55D0C8A4E000) is False  # the heap: no `hg`
    assert advised_huge(SMAPS, 0x7F3A40401000) is None  # one past the end: no mapping holds it


def test_the_kernels_thp_choice_is_the_bracketed_word() -> None:
    assert thp_mode("always [madvise] never\n") == "madvise"
    assert thp_mode("[always] madvise never") == "always"
    assert thp_mode("always madvise [never]") == "never"


# A fresh interpreter, as a rank starts: the heap bounded (or not) before its first tensor, or after one.
PROBE = """
import json, logging, sys, torch
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from memstrata.runtime.swap.hostheap import bound_host_heap, warn_without_huge_pages
if sys.argv[1] == "late":
    torch.zeros(1 << 20)  # a model built before the engine was opened
bound_host_heap()
print(json.dumps(warn_without_huge_pages()))
"""


def _probe(order: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    return subprocess.run([sys.executable, "-c", PROBE, order], env={**clean, **env}, capture_output=True,
                          text=True, timeout=120, check=True)


def _need_thp() -> None:
    if not thp_offered():
        unavailable(f"this kernel gives no transparent huge pages to a mapping that asks ({THP_SETTING})")


def test_tensors_of_a_run_that_bounds_its_heap_first_are_backed_by_huge_pages() -> None:
    _need_thp()
    done = _probe("first", {})
    assert json.loads(done.stdout) is True, done.stderr
    assert "huge pages" not in done.stderr


def test_a_process_that_allocated_before_the_bound_is_told_it_gets_no_huge_pages() -> None:
    _need_thp()
    late = _probe("late", {})
    assert json.loads(late.stdout) is False
    assert "THP_MEM_ALLOC_ENABLE=1" in late.stderr and "before memstrata set" in late.stderr
    # A user's explicit 0 is kept, and not warned about: they asked for it.
    refused = _probe("first", {"THP_MEM_ALLOC_ENABLE": "0"})
    assert json.loads(refused.stdout) is False and "huge pages" not in refused.stderr
    # ... and a user's explicit 1 gives them even to a process that allocated first.
    assert json.loads(_probe("late", {"THP_MEM_ALLOC_ENABLE": "1"}).stdout) is True
