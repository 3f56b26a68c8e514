"""`memstrata run --resume` as a user meets it: checkpoints of an earlier run are never silently overwritten, a
checkpoint of another model is refused in seconds naming what differs, and a job whose model is already saved
after its last step has nothing left to do."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from memstrata.api import load_job
from memstrata.api.checkpoint import Identity, Manifest

pytest.importorskip("torch")
from memstrata.runtime.train.checkpoints import ckptstore  # noqa: E402
from memstrata.runtime.train.checkpoints.checkpoint import memstrata_version  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "examples" / "finetune-tiny.yaml"


def foreign_checkpoint(root: Path, layers: int) -> None:
    """A complete checkpoint of gpt-tiny with `layers` layers (the example has 2)."""
    arch = load_job(TINY).spec.model.shape().model_dump(mode="json")
    identity = Identity(memstrata_version=memstrata_version(), model={**arch, "layers": layers}, precision="bf16",
                        world_size=1, sub_groups=[1])
    partial = ckptstore.partial_dir(root, 4)
    files = {"rank-00000.json": ckptstore.write_json(partial / "rank-00000.json", {})}
    ckptstore.finish(partial, Manifest(identity=identity, job="finetune-tiny", step=4, time=datetime.now(timezone.utc),
                                       engine="memstrata", micro_batches=4, files=files))


def test_checkpoints_of_an_earlier_run_need_resume(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    foreign_checkpoint(tmp_path / "ck", layers=2)
    r = cli("run", str(TINY), "--checkpoint", str(tmp_path / "ck"), "--nvme-path", str(tmp_path / "nvme"))
    assert r.returncode == 2, r.stderr
    assert "holds checkpoints up to step 4 of an earlier run" in r.stderr and "--resume" in r.stderr
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").iterdir())


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_built(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    foreign_checkpoint(tmp_path / "ck", layers=4)
    r = cli("run", str(TINY), "--checkpoint", str(tmp_path / "ck"), "--resume", "--nvme-path",
                str(tmp_path / "nvme"), timeout=60)
    assert r.returncode == 2, r.stderr
    assert "cannot resume from this checkpoint: model.layers: the checkpoint has 4, this job 2" in r.stderr
    assert "initializing DeepSpeed" not in r.stdout + r.stderr


def test_a_retry_after_the_model_was_saved_finishes_without_training(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "model"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"x" * 10)
    steps = load_job(TINY).spec.training.steps
    (out / "memstrata-run.json").write_text(json.dumps({"job": "finetune-tiny", "jobUid": "", "step": steps}))
    r = cli("run", str(TINY), "--output", str(out), "--resume", "--nvme-path", str(tmp_path / "nvme"))
    assert r.returncode == 0, r.stderr
    assert "already holds this job's model after step" in r.stderr
    # Someone else's model at the path (or this job's, saved at another step) is still never overwritten.
    (out / "memstrata-run.json").write_text(json.dumps({"job": "other", "jobUid": "", "step": steps}))
    r = cli("run", str(TINY), "--output", str(out), "--resume", "--nvme-path", str(tmp_path / "nvme"))
    assert r.returncode == 2 and "already exists" in r.stderr


def test_a_failing_checkpoint_volume_costs_the_checkpoint_not_the_run(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys
    import time

    ck = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "memstrata.cli", "run", str(TINY), "--steps", "40", "--checkpoint",
                             str(ck), "--checkpoint-every", "2", "--nvme-path", str(tmp_path / "nvme")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (ck / "step-00000002").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    # The volume goes bad under the run: every later checkpoint fails to write.
    shutil.rmtree(ck)
    ck.write_text("not a directory any more")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "warning: the checkpoint after step" in out and "training goes on" in out, out[-3000:]
    assert "step 40/40" in out


def test_resuming_at_the_last_step_saves_and_past_it_is_refused(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    ck, nvme = tmp_path / "ck", tmp_path / "nvme"
    r = cli("run", str(TINY), "--steps", "4", "--checkpoint", str(ck), "--checkpoint-every", "2", "--nvme-path",
            str(nvme))
    assert r.returncode == 0, r.stderr
    # An attempt that died in the export, after the step-4 checkpoint: nothing left to train, the model is saved.
    r = cli("run", str(TINY), "--steps", "4", "--checkpoint", str(ck), "--resume", "--output", str(tmp_path / "m"),
            "--nvme-path", str(nvme))
    assert r.returncode == 0, r.stderr
    assert "nothing left to train" in r.stdout and (tmp_path / "m" / "memstrata-run.json").is_file()
    r = cli("run", str(TINY), "--steps", "2", "--checkpoint", str(ck), "--resume", "--nvme-path", str(nvme))
    assert r.returncode == 2 and "the checkpoint is of step 4, past training.steps (2)" in r.stderr
