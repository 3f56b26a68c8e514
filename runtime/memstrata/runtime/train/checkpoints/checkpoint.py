"""Checkpoints of a training run, for both engines, and resuming from them.

What is saved is what the next step needs to be the step an uninterrupted run
would take: per optimizer sub-group, the fp32 master weights and the optimizer
moments (the 16-bit weights are their cast, re-derived on resume exactly as the
update derives them); the LR schedule; DeepSpeed's counters and loss scale; the
data position; and the Python, NumPy and torch RNGs.

The sub-groups are read through ZeRO-3's own swap-in/release calls, one at a
time, so stock ZeRO-Infinity reads its swap files and memstrata its NVMe extents
(or its DRAM cache) into the buffers a step would use, and each is written from
those buffers to the volume before the next is read: host memory grows by one
sub-group at most, never by the whole state. Nothing is written back to NVMe
while saving. Resuming goes the other way: each sub-group is swapped in, filled
from the checkpoint, its 16-bit partitions re-derived, and swapped out.

With several ranks (on one node or several sharing the checkpoint volume) each
rank writes and reads only its own files, named by its rank, in the one step
directory; rank 0 creates that directory and writes the manifest, the marker
and the rename once every rank's files are in. Whether a checkpoint is due,
whether it was written and which one to resume from are decided together
(memstrata.runtime.train.checkpoints.ckptgroup): the ranks never disagree about a step.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from memstrata.api.architecture import ModelArchitecture
from memstrata.api.checkpoint import (FORMAT, FileDigest, Identity, Manifest, SelectionState, group_file,
                                      identity_mismatches, rank_file)
from memstrata.api.jobdata import Checkpoint
from memstrata.api.jobstatus import CheckpointStatus
from memstrata.runtime.train.checkpoints import ckptstore
from memstrata.runtime.train.checkpoints.ckptgroup import Group, agree, outcome
from memstrata.runtime.train.checkpoints.ckptstore import CheckpointError, CheckpointWriteError, Found
from memstrata.runtime.train.checkpoints.engine_state import SubGroups, capture_rng, replay_cpu_adam_steps, restore_rng
from memstrata.runtime.train.model.tensorfile import TensorFile

__all__ = ["CheckpointError", "CheckpointWriteError", "Checkpointer", "Resumed"]

_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def memstrata_version() -> str:
    return importlib.metadata.version("memstrata")


# --- the checkpointer ---------------------------------------------------------------------------------
class Resumed:
    """Where a resumed run stands: its step and data position, and the checkpoints passed over."""

    def __init__(self, found: Found) -> None:
        self.directory, self.manifest, self.skipped = found.directory, found.manifest, found.skipped
        self.step = found.manifest.step
        self.micro_batches = found.manifest.micro_batches


class Checkpointer:
    """spec.checkpoint for one run: when to save, saving, and resuming."""

    def __init__(self, spec: Checkpoint, *, job: str, job_uid: str, arch: ModelArchitecture, precision: str,
                 engine_name: str, fingerprint: dict[str, Any]) -> None:
        """`fingerprint`: memstrata.api.checkpoint.run_fingerprint of the job, which a checkpoint must share."""
        self.spec, self.root = spec, Path(spec.path)
        self.job, self.job_uid, self.arch, self.precision = job, job_uid, arch, precision
        self.fingerprint = fingerprint
        self.engine_name = engine_name
        self.last_time = time.monotonic()
        self.latest: CheckpointStatus | None = None

    @staticmethod
    def _env_rank() -> int:
        """This process's global rank as the launcher set it (before torch.distributed exists)."""
        return int(os.environ.get("RANK", "0"))

    def check_path(self) -> None:
        """Refuse, before training, a checkpoint path that cannot take a directory; remove what interrupted
        writes left there (one run writes a job's checkpoints at a time; its rank 0 cleans up)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if self._env_rank() == 0:
                ckptstore.partial_dir(self.root, 0).rmdir()
                ckptstore.remove_partials(self.root)
            else:  # a name rank 0's clean-up (at this very moment) leaves alone
                Path(tempfile.mkdtemp(prefix=f".probe-rank{self._env_rank()}-", dir=self.root)).rmdir()
        except OSError as exc:
            raise CheckpointError(f"spec.checkpoint.path: {self.root}: cannot create a directory there: "
                                  f"{exc.strerror or exc}") from None

    def existing(self) -> Found | None:
        """The newest checkpoint here intact as far as this rank's files go (ckptstore.find_latest; all files with
        one rank); `resume` settles on the one intact for every rank."""
        return ckptstore.find_latest(self.root, self._env_rank())

    def to_resume(self, *, resume: bool, steps: int, expected_step: int | None) -> Found | None:
        """The checkpoint this run starts from (None: from step 0), or CheckpointError saying why it cannot start:
        checkpoints of an earlier run without `resume`; one of another run (everything but the sub-group layout
        is known before the engine exists, so this fails in seconds); one past the last step; or none as far as
        `expected_step` (what the job's status last reported) though nothing was damaged: the path lost them
        (not a persistent volume?), and starting over would silently throw the run away."""
        found = self.existing()
        if found is not None and not resume:
            raise CheckpointError(f"spec.checkpoint.path: {self.root} holds checkpoints up to step "
                                  f"{found.manifest.step} of an earlier run; resume from it (memstrata run --resume) "
                                  "or choose another path")
        if found is None or not found.skipped:
            have = found.manifest.step if found is not None else None
            if expected_step is not None and (have is None or have < expected_step):
                raise CheckpointError(
                    f"spec.checkpoint.path: {self.root}: the job's status reports a checkpoint of step {expected_step} "
                    f"but {'none is there' if have is None else f'the newest there is step {have}'}: the path must "
                    "be on a persistent volume the next attempt mounts too")
        if found is None:
            return None
        refusal = self.refusal(found)
        if refusal is not None:
            raise CheckpointError(refusal)
        if found.manifest.step > steps:
            raise CheckpointError(f"{found.directory}: the checkpoint is of step {found.manifest.step}, past "
                                  f"training.steps ({steps}); raise training.steps to train on from it")
        return found

    def identity(self, engine: Any = None) -> Identity:
        """This run's identity; before the engine exists (`engine` None) without the sub-group layout, and with
        the world size the launcher set. With the engine it is collective: every rank's layout, on every rank."""
        ranked: list[list[int]] = [[]]
        if engine is None:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        else:
            group = Group()
            world, ranked = group.world, group.gather(SubGroups(engine.optimizer).numels())
        return Identity(memstrata_version=memstrata_version(), model=self.arch.model_dump(mode="json"),
                        precision=self.precision, world_size=world, sub_groups=ranked[0],
                        rank_sub_groups=ranked if ranked[0] else [], job_uid=self.job_uid, job=self.job,
                        training=self.fingerprint)

    def refusal(self, found: Found, engine: Any = None) -> str | None:
        """Why `found` cannot resume this run (None: it can); collective with the engine (see identity)."""
        differences = identity_mismatches(found.manifest.identity, self.identity(engine))
        if found.manifest.format != FORMAT:
            differences.insert(0, f"format: the checkpoint is format {found.manifest.format}, this runtime reads "
                                  f"{FORMAT}")
        if not differences:
            return None
        return f"{found.directory}: cannot resume from this checkpoint: " + "; ".join(differences)

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after `step`; collective when minutes count: rank 0's clock decides, or
        the ranks could part ways, one writing a checkpoint while another trains on."""
        due = self.spec.due(step, (time.monotonic() - self.last_time) / 60)
        if self.spec.every_minutes is None and self.spec.every_steps is not None:
            return due  # the same step on every rank
        return Group().broadcast(due)

    def save(self, engine: Any, *, step: int, micro_batches: int, loss: float | None,
             validation_loss: float | None, selection: SelectionState | None = None) -> CheckpointStatus:
        """Write the checkpoint of `step`, on every rank together. CheckpointWriteError, the same on every rank,
        when the volume refused any rank's write: then nothing of it is left and training may go on; any other
        error (reading the state) is the run's."""
        started = time.monotonic()
        group = Group()
        identity = self.identity(engine)  # every rank's sub-group layout, gathered before anything is written
        # One partial directory, rank 0's, for every rank's files.
        made, error = outcome(lambda: self._written(self.root, lambda root, s: ckptstore.partial_dir(root, s),
                                                    step)) if group.rank == 0 else (None, None)
        where, error = group.broadcast((str(made) if made is not None else None, error))
        if where is None:
            self.last_time = time.monotonic()  # a failed time-based checkpoint is not retried after every step
            raise CheckpointWriteError(error or f"{self.root}: no directory for the checkpoint of step {step}")
        partial, status = Path(where), None
        try:
            files, error = outcome(lambda: self._write_rank(engine, partial, group.rank))
            written = group.gather((files or {}, error))
            error = next((e for _, e in written if e is not None), None)  # the lowest rank's, on every rank
            if error is None and group.rank == 0:
                scheduler = getattr(engine, "lr_scheduler", None)
                manifest = Manifest(
                    identity=identity, job=self.job, step=step, time=datetime.now(timezone.utc),
                    engine=self.engine_name, micro_batches=micro_batches,
                    scheduler=scheduler.state_dict() if scheduler is not None else None,
                    counters={k: int(getattr(engine, k)) for k in _COUNTERS if hasattr(engine, k)},
                    loss=loss, validation_loss=validation_loss, selection=selection,
                    files={k: v for f, _ in written for k, v in f.items()})
                final, error = outcome(lambda: self._written(partial, ckptstore.finish, manifest))
                if final is not None:
                    ckptstore.prune(self.root, self.spec.keep, final)  # only now: the new one is complete
                    status = CheckpointStatus(path=str(final), step=step, time=manifest.time,
                                              bytes=manifest.total_bytes, seconds=round(time.monotonic() - started, 3))
            if error is not None and group.rank == 0:
                ckptstore.shutil.rmtree(partial, ignore_errors=True)
            # Also the barrier: no rank trains on before the checkpoint is complete (or known to have failed).
            status, error = group.broadcast((status, error))
        except BaseException:
            ckptstore.shutil.rmtree(partial, ignore_errors=True)
            raise
        finally:
            self.last_time = time.monotonic()  # a failed time-based checkpoint is not retried after every step
            layer = getattr(engine, "memstrata", None)
            if layer is not None:
                layer.trim()  # give back the pool regions the sub-groups were read into, as after a step
        if error is not None or status is None:
            raise CheckpointWriteError(error or f"{self.root}: the checkpoint of step {step} was not written")
        self.latest = status
        return status

    def _write_rank(self, engine: Any, partial: Path, rank: int) -> dict[str, FileDigest]:
        """This rank's files: its sub-groups, one at a time, then its RNGs and optimizer scalars."""
        groups = SubGroups(engine.optimizer)
        files: dict[str, FileDigest] = {}
        scalars: list[dict[str, Any]] = []
        for i in range(len(groups)):
            tensors, group_scalars = groups.read(i)
            try:
                files[group_file(rank, i)] = self._written(partial / group_file(rank, i), ckptstore.write_tensors,
                                                           tensors)
            finally:
                groups.release(i)
            scalars.append(group_scalars)
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        files[rank_file(rank)] = self._written(partial / rank_file(rank), ckptstore.write_json, {
            "rng": capture_rng(), "groups": scalars,
            "loss_scaler": {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))}
            if scaler is not None else {}})
        return files

    @staticmethod
    def _written(path: Path, write: Callable[[Path, Any], Any], what: Any) -> Any:
        try:
            return write(path, what)
        except OSError as exc:
            raise CheckpointWriteError(f"{path}: {exc.strerror or exc}") from exc

    def resume(self, engine: Any, found: Found) -> Resumed:
        """Load `found` into the engine; CheckpointError naming every difference if it belongs to another run.
        Collective: every rank calls it with what it found (existing) and all settle on one checkpoint, or fail
        with the same error."""
        group = Group()
        found = agree(found, group)
        manifest = found.manifest
        refusal = self.refusal(found, engine)
        if refusal is not None:
            raise CheckpointError(refusal)
        if group.rank == 0:
            for directory in found.damaged:  # newer than the one resumed from: set aside, out of pruning's count
                if directory.exists():
                    ckptstore.quarantine(directory)
        rank = group.rank
        ranked = json.loads((found.directory / rank_file(rank)).read_text())
        groups = SubGroups(engine.optimizer)
        for i in range(len(groups)):
            with TensorFile(found.directory / group_file(rank, i)) as f:  # not mapped: a file cut short fails
                groups.write(i, f.get_tensor, list(f.keys()), ranked["groups"][i])
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        for key, value in ranked["loss_scaler"].items():
            setattr(scaler, key, value)
        for key, value in manifest.counters.items():
            setattr(engine, key, value)
        if "global_steps" in manifest.counters:
            # A checkpoint is taken on a step boundary; the run that took it may have had another number of micro-steps
            # per step (layer-major runs one), which would shift DeepSpeed's accumulation boundary.
            engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
        scheduler = getattr(engine, "lr_scheduler", None)
        if scheduler is not None and manifest.scheduler is not None:
            scheduler.load_state_dict(manifest.scheduler)
            # load_state_dict restores the schedule's position but not the rate in use until its next step
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
        adam_steps = [g["step"]["value"] for g in ranked["groups"] if "value" in g.get("step", {})]
        replay_cpu_adam_steps(engine.optimizer.optimizer, max(adam_steps, default=0))
        restore_rng(ranked["rng"])
        layer = getattr(engine, "memstrata", None)
        if layer is not None:
            layer.trim()  # the sub-groups were filled through the pool; the first step takes what it needs
        self.last_time = time.monotonic()
        self.latest = CheckpointStatus(path=str(found.directory), step=manifest.step, time=manifest.time,
                                       bytes=manifest.total_bytes)
        return Resumed(found)
