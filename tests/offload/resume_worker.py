"""One training attempt with checkpoints, optionally killed with SIGKILL at a chosen point, in its own process:
`resume_worker.py JOB.yaml NVME_DIR LOSSES.jsonl [--kill PHASE:STEP:MARKER]`.

Every attempt resumes from the newest intact checkpoint (as a pod does) and appends each finished step's loss
to LOSSES.jsonl (flushed and fsynced: what a killed attempt did survives it). With --kill, the process kills
itself with SIGKILL inside PHASE of optimizer step STEP, after writing PHASE and STEP to MARKER, so the test
knows the kill landed where it was aimed:
- forward:    in the forward pass, after the first transformer block ran;
- update:     in the optimizer update, with a write of optimizer state to NVMe submitted and not yet waited for
              (the second write of that update: some sub-groups are updated on NVMe, others not);
- checkpoint: while writing the checkpoint of that step, after its second file.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any


def die(marker: Path, phase: str, step: int) -> None:
    marker.write_text(f"{phase} {step}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def arm(recipe: Any, phase: str, step: int, marker: Path) -> None:
    from memstrata.runtime.swap.overlap import settle

    engine = recipe.engine
    state = {"step": 0, "in_update": False, "writes": 0, "files": 0, "updating": 0}
    original_step = engine.step

    def counted_step(*a: Any, **k: Any) -> Any:
        # The update before, still beside this step's forward (and, delayed, its backward), is joined first, so its
        # writes are counted as its own step's, never this one's.
        settle(engine.optimizer)
        state["in_update"] = engine.is_gradient_accumulation_boundary()
        if state["in_update"]:
            state["updating"] = current()  # the step this update takes, wherever it runs
        try:
            return original_step(*a, **k)
        finally:
            state["in_update"] = False

    engine.step = counted_step
    def current() -> int:  # the optimizer step being taken (DeepSpeed's counter is restored on resume)
        return int(engine.global_steps) + 1

    if phase == "forward":
        block = recipe.model.transformer.h[0] if hasattr(recipe.model, "transformer") else recipe.model.model.layers[0]

        def hook(_module: Any, _inputs: Any, _output: Any) -> None:
            if engine.training and current() == step:
                die(marker, phase, step)

        block.register_forward_hook(hook)
    elif phase == "update":
        from memstrata.runtime.swap.handle import ExtentSwapHandle

        def counting(real: Any) -> Any:
            def async_pwrite(*a: Any, **k: Any) -> Any:
                out = real(*a, **k)
                # In step() or, with the update beside the next forward (memstrata.runtime.swap.overlap), on its
                # thread after step() has returned.
                beside = threading.current_thread().name == "memstrata-update"
                if (state["in_update"] or beside) and state["updating"] == step:
                    state["writes"] += 1
                    if state["writes"] == 2:
                        die(marker, phase, step)  # submitted, not waited for
                return out
            return async_pwrite

        swapper = engine.optimizer.optimizer_swapper
        if isinstance(swapper.aio_handle, ExtentSwapHandle):
            # memstrata's update writes through several handles (the pipelined write-back has its own), whole
            # tensors or, for a sub-group updated a slice at a time, parts of them: count every optimizer write.
            for name in ("async_pwrite", "write_part"):
                real_write = getattr(ExtentSwapHandle, name)

                def optimizer_write(handle: Any, *a: Any, real_write: Any = real_write, **k: Any) -> Any:
                    if handle.kind != "optimizer":
                        return real_write(handle, *a, **k)
                    return counting(lambda *a2, **k2: real_write(handle, *a2, **k2))(*a, **k)

                setattr(ExtentSwapHandle, name, optimizer_write)
        else:
            real = swapper.aio_handle

            class Handle:
                def __getattr__(self, name: str) -> Any:
                    return getattr(real, name)

                async_pwrite = staticmethod(counting(real.async_pwrite))

            swapper.aio_handle = Handle()
    elif phase == "checkpoint":
        from memstrata.runtime.train.checkpoints import ckptstore

        write = ckptstore.write_tensors

        def killing_write(path: Path, tensors: Any) -> Any:
            out = write(path, tensors)
            if path.parent.name.startswith(f".step-{step:08d}."):
                state["files"] += 1
                if state["files"] == 2:
                    die(marker, phase, step)
            return out

        ckptstore.write_tensors = killing_write
    else:
        raise SystemExit(f"unknown phase {phase}")


def main() -> int:
    job_file, nvme, losses = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    kill = sys.argv[5].split(":") if len(sys.argv) > 5 and sys.argv[4] == "--kill" else None
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from memstrata.api import load_job
    from memstrata.node.local import local_inventory
    from memstrata.plan import plan_job
    from memstrata.runtime.train.recipe import FineTuneRecipe

    job = load_job(job_file)
    plan = plan_job(job.spec, local_inventory(nvme))
    recipe = FineTuneRecipe(job, plan, nvme, resume=True)
    recipe.setup()
    try:
        if kill is not None:
            arm(recipe, kill[0], int(kill[1]), Path(kill[2]))
        resumed = recipe.resumed.step if recipe.resumed is not None else 0
        with losses.open("a") as out:
            out.write(json.dumps({"attempt_resumed_from": resumed,
                                  "skipped": recipe.resumed.skipped if recipe.resumed else []}) + "\n")
            out.flush()

            def on_step(s: Any) -> None:
                out.write(json.dumps({"step": s.step, "loss": s.loss.hex(), "grad_norm": s.grad_norm}) + "\n")
                out.flush()
                os.fsync(out.fileno())

            recipe.train(on_step)
            swap = recipe.memstrata_status()
            out.write(json.dumps({"update_overlap": swap.update_overlap.wire() if swap is not None else None}) + "\n")
    finally:
        recipe.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
