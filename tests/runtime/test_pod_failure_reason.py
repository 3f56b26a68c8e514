"""A pod whose run fails says why in its termination message — the dataset's file and line, not "the lines
above say why" — because that message is what the operator puts in the job's Failed condition (the
user sees neither the container's log nor its lines above)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memstrata.api import load_job
from memstrata.node.local import local_inventory
from memstrata.operator.observe import job_view
from memstrata.operator.render import gang_objects
from memstrata.plan import plan_job
from memstrata.runtime.train import pod

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "finetune-tiny.yaml"


def _config(tmp_path: Path, dataset: Path) -> Path:
    spec = load_job(TINY).spec
    spec = spec.model_copy(update={"dataset": spec.dataset.model_copy(update={"synthetic": None,
                                                                          "path": str(dataset)})})
    body = {"metadata": {"name": "tiny", "namespace": "team-a", "uid": "u-1"}, "spec": spec.wire()}
    plan = plan_job(spec, local_inventory(tmp_path / "nvme"))
    companions, _ = gang_objects(job_view(body), ("node-1",), plan, attempt=0)
    path = tmp_path / "runtime-config.json"
    path.write_text(next(o for o in companions if o["kind"] == "ConfigMap")["data"]["runtime-config.json"])
    return path


# The kubelet hands each container an empty file; a stale one (a local rerun) must be replaced too.
@pytest.mark.parametrize("earlier", ["", "a stale message\n"], ids=["fresh", "stale"])
def test_a_bad_dataset_line_is_the_pods_termination_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              earlier: str) -> None:
    # A JSONL file whose second line is broken, as hand-edited files are.
    bad = tmp_path / "chat.jsonl"
    bad.write_text(json.dumps({"text": "one"}) + "\n" + '{"text": "two"},\n')
    config = _config(tmp_path, bad)
    termination = tmp_path / "termination-log"
    termination.write_text(earlier)
    monkeypatch.setattr(pod, "TERMINATION_LOG", termination)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    rc = pod.run_pod(scratch, config_path=str(config), patcher=lambda ref: lambda patch: None)
    assert rc == pod.EXIT_USAGE
    message = termination.read_text()
    assert message.startswith(f"error: {bad}:2: "), message
    assert "the lines above say why" not in message
