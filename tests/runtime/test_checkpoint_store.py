"""Checkpoint directories: streamed safetensors files that safetensors reads back, completion by rename and
marker, damage detected by size and sha256 with the previous checkpoint taken instead, pruning, and the rule
for which checkpoint may resume which run."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402

from memstrata.api.checkpoint import Identity, Manifest, identity_mismatches  # noqa: E402
from memstrata.api.finetunejob import Checkpoint  # noqa: E402
from memstrata.runtime.train import ckptstore  # noqa: E402
from memstrata.runtime.train.ckptstore import CheckpointError  # noqa: E402

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
    from memstrata.runtime.train.checkpoint import Checkpointer

    spec = Checkpoint(path=str(tmp_path / "ck"))
    ck = Checkpointer(spec, job="j", job_uid="u", arch=PRESETS["gpt-tiny"], precision="bf16", engine_name="memstrata",
                      fingerprint={})
    ck.check_path()
    with pytest.raises(CheckpointError, match="reports a checkpoint of step 40 but none is there: the path must be "
                                              "on a persistent volume"):
        ck.to_resume(resume=True, steps=100, expected_step=40)
    assert ck.to_resume(resume=True, steps=100, expected_step=None) is None  # a first attempt starts at 0
