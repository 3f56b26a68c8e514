"""Entry functions for workers started by memstrata.runtime.train.launch in tests (spawned: importable by name)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def report_threads(out_dir: str) -> None:
    """What a rank computes with once it has set itself up as memstrata's workers do."""
    import torch

    from memstrata.runtime.train.launch import Ranks, worker_setup

    ranks = Ranks.from_env()
    worker_setup(ranks.local_world)
    Path(out_dir, f"rank{ranks.rank}.json").write_text(json.dumps(
        {"omp": os.environ.get("OMP_NUM_THREADS"), "torch": torch.get_num_threads()}))
