"""One rank of a training attempt with checkpoints, started by torch elastic (`python -m torch.distributed.run
--nproc-per-node 2 ranked_resume_worker.py JOB.yaml NVME_DIR LOSSES.jsonl PIDS_DIR [--pause-after STEP MARKER]
[--rank1-disk-full-at STEP]`).

Every attempt resumes from the newest checkpoint intact for every rank (as a pod does). Each rank writes its pid
to PIDS_DIR/rank-R (torch elastic starts each rank in a session of its own: the test kills them all, as a pod's
end does). Every rank appends each finished step's loss (the whole world's) and checkpoint outcome to
LOSSES.jsonl, tagged with its rank, flushed and fsynced. --rank1-disk-full-at makes rank 1's checkpoint volume
refuse the writes of that step's checkpoint (ENOSPC), as a full disk does.
With --pause-after, rank 0 writes STEP to MARKER after that step and then waits to be killed: the other rank is
inside the next step by then, so the kill lands mid-run, with the checkpoints up to STEP written.
"""
from __future__ import annotations

import argparse
import errno
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


def fail_writes(step: int) -> None:
    """This rank's checkpoint volume is full at `step`: its first file write there fails with ENOSPC."""
    from memstrata.runtime.train.checkpoints import ckptstore

    write = ckptstore.write_tensors

    def full(path: Path, tensors: Any) -> Any:
        if path.parent.name.startswith(f".step-{step:08d}."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(path, tensors)

    ckptstore.write_tensors = full


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("job", "nvme", "losses", "pids"):
        parser.add_argument(name, type=Path)
    parser.add_argument("--pause-after", nargs=2, metavar=("STEP", "MARKER"))
    parser.add_argument("--rank1-disk-full-at", type=int, metavar="STEP")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank tells where it waits
    (args.pids / f"rank-{rank}").write_text(f"{os.getpid()}\n")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from memstrata.api import load_job
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job
    from memstrata.runtime.train.recipe import FineTuneRecipe

    if args.rank1_disk_full_at is not None and rank == 1:
        fail_writes(args.rank1_disk_full_at)
    job = load_job(args.job)
    plan = plan_job(job.spec, local_inventory(args.nvme))
    recipe = FineTuneRecipe(job, plan, args.nvme, resume=True)
    recipe.setup()
    try:
        with args.losses.open("a") as out:
            def record(obj: dict[str, Any]) -> None:
                out.write(json.dumps({"rank": rank, **obj}) + "\n")  # one short O_APPEND write: never interleaved
                out.flush()
                os.fsync(out.fileno())

            resumed = recipe.resumed
            record({"attempt_resumed_from": resumed.step if resumed is not None else 0,
                    "skipped": resumed.skipped if resumed is not None else []})

            def on_step(s: Any) -> None:
                record({"step": s.step, "loss": s.loss.hex(), "checkpoint_error": s.checkpoint_error,
                        "checkpoint": s.checkpoint.model_dump(mode="json") if s.checkpoint else None})
                if args.pause_after is not None and s.step == int(args.pause_after[0]) and rank == 0:
                    Path(args.pause_after[1]).write_text(f"{s.step}\n")
                    time.sleep(600)

            recipe.train(on_step)
    finally:
        recipe.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
