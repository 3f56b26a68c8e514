"""Checkpoint directories: streamed safetensors files that safetensors reads back, completion by rename and
marker, damage detected by size and sha256 with the previous checkpoint taken instead, pruning, and the rule
for which checkpoint may resume which run."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402

from memstrata.api.checkpoint import Identity, Manifest, identity_mismatches  # noqa: E402
from memstrata.api.jobdata import Checkpoint  # noqa: E402
from memstrata.runtime.train.checkpoints import ckptstore  # noqa: E402
from memstrata.runtime.train.checkpoints.ckptstore import CheckpointError  # noqa: E402

IDENTITY = Identity(memstrata_version="0.1.0", model={"layers": 2, "hidden": 128}, precision="bf16", world_size=1,
                    sub_groups=[100, 28])


def checkpoint(root: Path, step: int, identity: Identity = IDENTITY) -> Path:
    partial = ckptstore.partial_dir(root, step)
    files = {"group-0.safetensors": ckptstore.write_tensors(partial / "group-0.safetensors", {
        "master": torch.arange(100, dtype=torch.float32) * step,
        "state.exp_avg": torch.full((100,), 0.5, dtype=torch.float32),
        "weights": torch.arange(28, dtype=torch.bfloat16)})}
    files["rank-00000.json"] = ckptstore.write_json(partial / "rank-00000.json", {"rng": [1, 2, 3]})
    manifest = Manifest(identity=identity, job="j", step=step, time=datetime.now(timezone.utc), engine="memstrata",
                        micro_batches=step * 2, files=files)
    return ckptstore.finish(partial, manifest)


def test_tensors_written_from_their_own_memory_read_back_with_safetensors(tmp_path: Path) -> None:
    d = checkpoint(tmp_path, 3)
    with safe_open(str(d / "group-0.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("master"), torch.arange(100, dtype=torch.float32) * 3)
        assert torch.equal(f.get_tensor("weights"), torch.arange(28, dtype=torch.bfloat16))
        assert f.get_tensor("state.exp_avg").dtype == torch.float32
    assert ckptstore.verify(d).micro_batches == 6


def test_a_truncated_or_corrupt_newest_checkpoint_is_passed_over_for_the_previous_one(tmp_path: Path) -> None:
    checkpoint(tmp_path, 2)
    four = checkpoint(tmp_path, 4)
    six = checkpoint(tmp_path, 6)
    group = six / "group-0.safetensors"
    with group.open("r+b") as f:
        f.truncate(group.stat().st_size - 10)
    data = bytearray((four / "group-0.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, one bit flipped
    (four / "group-0.safetensors").write_bytes(bytes(data))

    found = ckptstore.find_latest(tmp_path)
    assert found is not None and found.manifest.step == 2
    assert "truncated" in found.skipped[0] and "step-00000006" in found.skipped[0]
    assert "corrupt" in found.skipped[1] and "step-00000004" in found.skipped[1]


def test_no_intact_checkpoint_is_an_error_naming_each_never_a_silent_restart(tmp_path: Path) -> None:
    only = checkpoint(tmp_path, 2)
    (only / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match=r"no intact checkpoint: .*step-00000002: no COMPLETE marker"):
        ckptstore.find_latest(tmp_path)
    assert ckptstore.find_latest(tmp_path / "empty") is None


def test_a_manifest_edited_after_completion_is_detected(tmp_path: Path) -> None:
    d = checkpoint(tmp_path, 2)
    text = (d / "checkpoint.json").read_text().replace('"microBatches": 4', '"microBatches": 5')
    (d / "checkpoint.json").write_text(text)
    with pytest.raises(CheckpointError, match="sha256 differs from the one in COMPLETE"):
        ckptstore.verify(d)


def test_pruning_keeps_the_newest_and_partials_of_dead_writers_are_removed(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        checkpoint(tmp_path, step)
    dead = ckptstore.partial_dir(tmp_path, 10)
    (dead / "group-0.safetensors").write_bytes(b"half")
    ckptstore.prune(tmp_path, keep=2, newest=tmp_path / "step-00000008")
    ckptstore.remove_partials(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000008"]


def test_a_damaged_newer_checkpoint_set_aside_never_costs_an_intact_one_its_place(tmp_path: Path) -> None:
    """Resumed from step 2 because step 8 is damaged, a run writes step 4 with keep=1: step 4 must survive."""
    checkpoint(tmp_path, 2)
    eight = checkpoint(tmp_path, 8)
    (eight / "COMPLETE").unlink()
    found = ckptstore.find_latest(tmp_path)
    assert found is not None and found.manifest.step == 2 and found.damaged == [eight]
    aside = ckptstore.quarantine(eight)
    four = checkpoint(tmp_path, 4)
    ckptstore.prune(tmp_path, keep=1, newest=four)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([aside.name, "step-00000004"])
    assert ckptstore.find_latest(tmp_path).manifest.step == 4  # type: ignore[union-attr]


def test_another_model_precision_world_size_version_or_job_is_refused_naming_each_difference() -> None:
    other = IDENTITY.model_copy(update={"memstrata_version": "0.2.0", "model": {"layers": 4, "hidden": 128},
                                        "precision": "fp16", "world_size": 2, "job_uid": "a"})
    why = identity_mismatches(other, IDENTITY.model_copy(update={"job_uid": "b"}))
    assert [w.split(":")[0] for w in why] == ["memstrata version", "model.layers", "training.precision",
                                              "world size", "job"]
    assert "does not reshard" in why[3]
    assert identity_mismatches(IDENTITY, IDENTITY) == []
    # Before the engine exists the layout is unknown, and not held against the checkpoint.
    assert identity_mismatches(IDENTITY, IDENTITY.model_copy(update={"sub_groups": []})) == []
    assert "optimizer sub-groups" in identity_mismatches(IDENTITY, IDENTITY.model_copy(update={"sub_groups": [128]}))[0]


@pytest.mark.parametrize(("spec", "step", "minutes", "due"), [
    ({"everySteps": 5}, 10, 0.0, True),
    ({"everySteps": 5}, 11, 999.0, False),
    ({"everyMinutes": 10}, 3, 10.5, True),
    ({"everyMinutes": 10}, 3, 9.0, False),
    ({}, 7, 30.0, True),  # neither set: every 30 minutes
    ({"everySteps": 5, "everyMinutes": 1}, 3, 2.0, True),
])
def test_when_a_checkpoint_is_due(spec: dict[str, object], step: int, minutes: float, due: bool) -> None:
    assert Checkpoint.model_validate({"path": "/c", **spec}).due(step, minutes) is due


def test_a_path_that_lost_the_checkpoints_the_status_reported_fails_rather_than_starting_over(tmp_path: Path) -> None:
    from memstrata.api.architecture import PRESETS
    from memstrata.runtime.train.checkpoints.checkpoint import Checkpointer

    spec = Checkpoint(path=str(tmp_path / "ck"))
    ck = Checkpointer(spec, job="j", job_uid="u", arch=PRESETS["gpt-tiny"], precision="bf16", engine_name="memstrata",
                      fingerprint={})
    ck.check_path()
    with pytest.raises(CheckpointError, match="reports a checkpoint of step 40 but none is there: the path must be "
                                              "on a persistent volume"):
        ck.to_resume(resume=True, steps=100, expected_step=40)
    assert ck.to_resume(resume=True, steps=100, expected_step=None) is None  # a first attempt starts at 0


def test_each_rank_checks_its_own_files_so_damage_to_another_ranks_is_found_by_that_rank(tmp_path: Path) -> None:
    partial = ckptstore.partial_dir(tmp_path, 2)
    files = {name: ckptstore.write_tensors(partial / name, {"master": torch.ones(10)})
             for name in ("rank-00000-group-00000.safetensors", "rank-00001-group-00000.safetensors")}
    two = ckptstore.finish(partial, Manifest(identity=IDENTITY.model_copy(update={"world_size": 2}), job="j", step=2,
                                             time=datetime.now(timezone.utc), engine="deepspeed", micro_batches=4,
                                             files=files))
    (two / "rank-00001-group-00000.safetensors").write_bytes(b"half")
    assert ckptstore.verify(two, rank=0).step == 2
    with pytest.raises(CheckpointError, match=r"rank-00001-group-00000.safetensors: 4 bytes, .*truncated"):
        ckptstore.verify(two, rank=1)
    with pytest.raises(CheckpointError, match="rank-00001"):
        ckptstore.verify(two)  # one process alone checks every file


def test_another_ranks_sub_group_layout_is_refused() -> None:
    two = IDENTITY.model_copy(update={"world_size": 2, "rank_sub_groups": [[100, 28], [100, 28]]})
    assert identity_mismatches(two, two) == []
    other = two.model_copy(update={"rank_sub_groups": [[100, 28], [120]]})
    assert identity_mismatches(two, other) == [
        "optimizer sub-groups: the checkpoint has 4 (256 elements), this run 3 (248 elements)"]


_RANK_SCRIPT = """
import json, os, sys, time
from pathlib import Path
import torch.distributed as dist
from memstrata.api.architecture import PRESETS
from memstrata.api.jobdata import Checkpoint
from memstrata.runtime.train.checkpoints import ckptstore
from memstrata.runtime.train.checkpoints.checkpoint import Checkpointer, CheckpointError
from memstrata.runtime.train.checkpoints.ckptgroup import Group, agree

dist.init_process_group("gloo")
rank, root = dist.get_rank(), Path(sys.argv[1])
ck = Checkpointer(Checkpoint(path=str(root), everyMinutes=1), job="j", job_uid="", arch=PRESETS["gpt-tiny"],
                  precision="fp32", engine_name="deepspeed", fingerprint={})
ck.last_time = time.monotonic() - (0 if rank == 0 else 120)  # only rank 1's clock says a checkpoint is due
due = ck.due(1)
found = ck.existing()
chosen = agree(found, Group())
print(json.dumps({"due": due, "own": found.manifest.step, "chosen": chosen.manifest.step, "skipped": chosen.skipped}))
sys.stdout.flush()
# Leave together: a rank whose peer has already closed its gloo pair can abort in the pair's destructor.
dist.barrier()
dist.destroy_process_group()
"""


def test_ranks_decide_together_when_a_checkpoint_is_due_and_which_to_resume_from(tmp_path: Path) -> None:
    """Two real gloo ranks: rank 0's clock decides a time-based checkpoint for both; rank 1's file of the newest
    checkpoint is damaged, so rank 1 alone would take step 2 and rank 0 step 4: both settle on step 2."""
    import os
    import socket
    import subprocess
    import sys

    for step in (2, 4):
        partial = ckptstore.partial_dir(tmp_path, step)
        files = {f"rank-{r:05d}-group-00000.safetensors": ckptstore.write_tensors(
            partial / f"rank-{r:05d}-group-00000.safetensors", {"master": torch.ones(10) * step}) for r in (0, 1)}
        ckptstore.finish(partial, Manifest(identity=IDENTITY.model_copy(update={"world_size": 2}), job="j", step=step,
                                           time=datetime.now(timezone.utc), engine="deepspeed",
                                           micro_batches=step * 2, files=files))
    (tmp_path / "step-00000004" / "rank-00001-group-00000.safetensors").write_bytes(b"half")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}) for r in (0, 1)]
    out = [json.loads(p.communicate(timeout=120)[0].splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [o["due"] for o in out] == [False, False]
    assert [o["own"] for o in out] == [4, 2] and [o["chosen"] for o in out] == [2, 2]
    assert all("rank-00001-group-00000.safetensors" in o["skipped"][0] for o in out)
