"""The ranks of a node share its cores: each computes (torch, and DeepSpeed's CPU Adam through OpenMP) with its
share, on a GPU node as on a CPU one. Real torch elastic workers, spawned as `memstrata run` spawns them."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from memstrata.runtime.train.launch import launch, local_rendezvous, threads_per_rank

from launch_entry import report_threads


def test_each_rank_computes_with_its_share_of_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch(report_threads, (str(tmp_path),), ranks=2, rendezvous=local_rendezvous("threads")) == 0
    share = threads_per_rank(2)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # OpenMP reads OMP_NUM_THREADS when it starts, before any of memstrata's code: the worker must inherit it.
        assert seen == {"omp": str(share), "torch": share}, rank
    assert "OMP_NUM_THREADS" not in os.environ  # the launching process's own environment is left as it was


def test_a_users_omp_num_threads_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch(report_threads, (str(tmp_path),), ranks=2, rendezvous=local_rendezvous("threads")) == 0
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"omp": "3", "torch": 3}
