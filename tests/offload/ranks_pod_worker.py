"""One pod of a job, as the operator starts it (`memstrata pod`), with its status patches recorded instead of sent:
`ranks_pod_worker.py SCRATCH RUNTIME_CONFIG.json PATCHES.jsonl`. The operator's env (PET_NODE_RANK, PET_NNODES,
MASTER_ADDR, MASTER_PORT) comes from the caller. Every process that reports (a rank spawned by torch elastic
imports `recorder` from here by name) appends `{"rank": RANK, "patch": ...}` lines to PATCHES.jsonl.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PATCHES_ENV = "RANKS_TEST_PATCHES"


def _append(body: dict[str, Any]) -> None:
    with open(os.environ[PATCHES_ENV], "a") as f:  # one short line per write: whole lines even with two writers
        f.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "patch": body}) + "\n")


def recorder(_ref: object) -> Callable[[dict[str, Any]], None]:
    return _append


def main() -> int:
    scratch, config, patches = sys.argv[1:4]
    os.environ[PATCHES_ENV] = patches
    from memstrata.runtime.train.pod import run_pod

    return run_pod(Path(scratch), config_path=config, patcher=recorder)


if __name__ == "__main__":
    sys.exit(main())
