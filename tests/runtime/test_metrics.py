"""metrics.jsonl and the TensorBoard event files: what a user reads back, after a clean run, a kill and a resume."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memstrata.runtime.train.observe.metrics import METRICS_FILE, MetricsError, MetricsWriter, check_metrics_dir
from memstrata.runtime.train.observe.metrics import StepResult

REPO = Path(__file__).resolve().parents[2]


def _step(step: int, loss: float, **kw: float) -> StepResult:
    return StepResult(step=step, loss=loss, seconds=0.5, tokens=256, learning_rate=1e-3 * step, **kw)


def _lines(directory: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (directory / METRICS_FILE).read_text().splitlines()]


def _tensorboard(directory: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]


def test_every_step_is_on_disk_as_soon_as_it_is_written(tmp_path: Path) -> None:
    out = tmp_path / "m" / "nested"  # created with its parents
    writer = MetricsWriter(out).open()
    writer.write_validation(0, 3.5)
    writer.write_step(_step(1, 3.0, grad_norm=2.0))
    # Not closed yet: a run killed here still leaves both records and the event file readable.
    lines = _lines(out)
    assert lines[0]["step"] == 0 and lines[0]["validation_loss"] == 3.5 and "loss" not in lines[0]
    assert {k: lines[1][k] for k in ("step", "loss", "learning_rate", "tokens", "tokens_per_second", "seconds",
                                     "grad_norm")} == {"step": 1, "loss": 3.0, "learning_rate": 1e-3, "tokens": 256,
                                                       "tokens_per_second": 512.0, "seconds": 0.5, "grad_norm": 2.0}
    assert lines[1]["wall_time"] >= lines[0]["wall_time"] > 0
    assert _tensorboard(out, "train/loss") == [(1, 3.0)]
    assert _tensorboard(out, "validation/loss") == [(0, 3.5)]
    writer.close()


def test_resume_drops_the_replayed_steps_from_both_files(tmp_path: Path) -> None:
    first = MetricsWriter(tmp_path).open()
    first.write_validation(0, 4.0)
    for k in range(1, 6):
        first.write_step(_step(k, 10.0 + k))
    first.close()
    # The process was killed mid-line after step 5.
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"step": 6, "lo')

    resumed = MetricsWriter(tmp_path, resume_step=3).open()
    assert [line["step"] for line in _lines(tmp_path)] == [0, 1, 2, 3]
    for k in (4, 5):
        resumed.write_step(_step(k, 20.0 + k, validation_loss=1.0) if k == 5 else _step(k, 20.0 + k))
    resumed.close()

    lines = _lines(tmp_path)
    assert [(line["step"], line.get("loss")) for line in lines] == [(0, None), (1, 11.0), (2, 12.0), (3, 13.0),
                                                                   (4, 24.0), (5, 25.0)]
    # TensorBoard shows each step once: the first attempt's steps 4 and 5 are purged.
    assert _tensorboard(tmp_path, "train/loss") == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0)]
    assert _tensorboard(tmp_path, "validation/loss") == [(0, 4.0), (5, 1.0)]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("events.")) == [METRICS_FILE]


def test_a_fresh_run_starts_the_metrics_anew(tmp_path: Path) -> None:
    old = MetricsWriter(tmp_path).open()
    old.write_step(_step(1, 9.0))
    old.close()
    new = MetricsWriter(tmp_path).open()
    new.write_step(_step(1, 5.0))
    new.close()
    assert [line["loss"] for line in _lines(tmp_path)] == [5.0]
    assert _tensorboard(tmp_path, "train/loss") == [(1, 5.0)]


def test_a_directory_that_cannot_be_created_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(MetricsError, match=r"spec.output.metricsPath: .*a-file/metrics: cannot create it"):
        check_metrics_dir(blocker / "metrics")
    check_metrics_dir(tmp_path / "new" / "metrics")  # creatable: fine, and nothing is left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_the_cli_refuses_an_uncreatable_metrics_path_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    doc = yaml.safe_load((REPO / "examples" / "finetune-tiny.yaml").read_text())
    doc["spec"]["output"] = {"path": str(tmp_path / "model"), "metricsPath": str(blocker / "metrics")}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    proc = subprocess.run([sys.executable, "-m", "memstrata.cli", "run", str(job), "--nvme-path", str(nvme)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "spec.output.metricsPath" in lines[0] and str(blocker) in lines[0], proc.stderr
    assert list(nvme.iterdir()) == [] and not (tmp_path / "model").exists()
