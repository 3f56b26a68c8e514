"""`memstrata pod`: what the operator renders is what the runtime reads; bad configs are named; status
patches are paced and never stop training (the real API server is in e2e/operator/test_pod_runtime.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memstrata.api import load_job
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.jobdata import Checkpoint
from memstrata.api.report import RuntimeReport
from memstrata.api.runtimeconfig import RuntimeConfig
from memstrata.operator.observe import job_view
from memstrata.operator.render import gang_objects
from memstrata.plan import plan_job
from memstrata.node.local import local_inventory
from memstrata.runtime.train.pod import PodConfigError, StatusReporter, job_and_plan, load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "finetune-tiny.yaml"


def rendered_config(tmp_path: Path, **spec: Any) -> Path:
    """The runtime config exactly as the operator renders it into the job's ConfigMap (`spec`: fields added to
    the tiny example's spec)."""
    job = load_job(TINY)
    plan = plan_job(job.spec, local_inventory(tmp_path / "nvme"))
    body = {"metadata": {"name": job.metadata.name, "namespace": "team-a", "uid": "u-1"},
            "spec": {**job.spec.wire(), **spec}}
    companions, _ = gang_objects(job_view(body), ("node-1",), plan, attempt=0, report_interval_seconds=3)
    cm = next(o for o in companions if o["kind"] == "ConfigMap")
    path = tmp_path / "runtime-config.json"
    path.write_text(cm["data"]["runtime-config.json"])
    return path


def test_the_operators_config_becomes_the_same_job_and_plan(tmp_path: Path) -> None:
    cfg = load_config(rendered_config(tmp_path))
    assert (cfg.job.name, cfg.job.namespace, cfg.report_interval_seconds) == ("finetune-tiny", "team-a", 3)
    job, plan = job_and_plan(cfg)
    original = load_job(TINY)
    assert job.spec.training == original.spec.training and job.spec.memory == original.spec.memory
    assert job.spec.memory.engine == "memstrata"
    assert plan.feasible and plan.parameters == 527_872


def test_the_checkpoint_spec_reaches_the_runtimes_job(tmp_path: Path) -> None:
    """A retried pod resumes only if its job still says where the checkpoints are."""
    checkpoint = {"path": "/data/ckpt", "everyMinutes": 15, "keep": 1}
    job, _ = job_and_plan(load_config(rendered_config(tmp_path, checkpoint=checkpoint)))
    assert job.spec.checkpoint is not None and job.spec.checkpoint == Checkpoint.model_validate(checkpoint)
    job, _ = job_and_plan(load_config(rendered_config(tmp_path)))
    assert job.spec.checkpoint is None


@pytest.mark.parametrize("edit, expected", [
    (lambda d: d.update(version="memstrata.dev/runtime-config/v3"),
     r"version 'memstrata.dev/runtime-config/v3' is not 'memstrata.dev/runtime-config/v2'"),
    (lambda d: d["spec"]["training"].update(steps=-1), r"spec.training.steps: Input should be greater than or equal to 0"),
    (lambda d: d.pop("plan"), r": plan: Field required"),
])
def test_a_wrong_config_is_named_with_the_file_and_field(tmp_path: Path, edit: Any, expected: str) -> None:
    path = rendered_config(tmp_path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(PodConfigError, match=rf"^{path}.*{expected}"):
        load_config(path)


def test_missing_unset_and_non_json_configs(tmp_path: Path) -> None:
    with pytest.raises(PodConfigError, match=r"\$MEMSTRATA_RUNTIME_CONFIG is not set"):
        load_config(None)
    with pytest.raises(PodConfigError, match=rf"{tmp_path}/nope.json: cannot read the runtime config"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("steps: 3\n")
    with pytest.raises(PodConfigError, match=rf"{bad}: not JSON"):
        load_config(bad)


def test_the_pod_command_refuses_a_bad_config_with_exit_2(tmp_path: Path) -> None:
    path = rendered_config(tmp_path)
    data = json.loads(path.read_text())
    data["version"] = "memstrata.dev/runtime-config/v0"
    path.write_text(json.dumps(data))
    env = {**os.environ, "MEMSTRATA_RUNTIME_CONFIG": str(path), "MEMSTRATA_SCRATCH": str(tmp_path / "scratch")}
    proc = subprocess.run([sys.executable, "-m", "memstrata.cli", "pod"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{path}: version 'memstrata.dev/runtime-config/v0'" in proc.stderr
    assert "Traceback" not in proc.stderr


def _report(stage: str, step: int) -> RuntimeReport:
    return RuntimeReport(stage=stage, step=step, total_steps=10, loss=2.0, elapsed_seconds=step)  # type: ignore[arg-type]


def test_reports_are_paced_but_the_last_one_always_goes() -> None:
    sent: list[dict[str, Any]] = []
    now = [0.0]
    reporter = StatusReporter(sent.append, interval=10, clock=lambda: now[0])
    for step in range(1, 10):
        now[0] = step * 3.0  # a step every 3 s: a patch every 10 s at most
        reporter(_report("training", step))
    reporter(_report("finished", 10))
    steps = [p["status"]["progress"]["step"] for p in sent]
    assert steps == [1, 5, 9, 10]  # t=3, 15, 27: never two within 10 s; then the final one
    assert sent[-1]["status"]["progress"]["summary"] == "10/10 (100%)"


def test_the_saved_model_is_reported_at_once_and_once() -> None:
    from memstrata.api.jobstatus import OutputStatus

    sent: list[dict[str, Any]] = []
    now = [0.0]
    reporter = StatusReporter(sent.append, interval=10, clock=lambda: now[0])
    reporter(_report("training", 1))
    saved = _report("training", 1).model_copy(update={"output": OutputStatus(path="/out/m", step=1, files=4,
                                                                              bytes=1 << 20)})
    now[0] = 1.0  # within the interval: a step report would wait, the saved model does not
    reporter(saved)
    now[0] = 2.0
    reporter(saved)  # nothing new: paced again
    assert len(sent) == 2 and sent[1]["status"]["output"]["path"] == "/out/m"


def test_a_new_checkpoint_is_reported_at_once_and_says_which_attempt_wrote_it() -> None:
    """The operator announces a checkpoint when status.checkpoint changes, and a resume only for the attempt
    that reported it: each patch names the pod's attempt and clears what an earlier attempt left in progress."""
    from datetime import datetime, timezone

    from memstrata.api.jobstatus import CheckpointStatus

    sent: list[dict[str, Any]] = []
    now = [0.0]
    reporter = StatusReporter(sent.append, interval=10, clock=lambda: now[0], attempt=2)
    reporter(_report("training", 1))
    ckpt = CheckpointStatus(path="/ckpt/step-00000002", step=2, time=datetime(2026, 1, 1, tzinfo=timezone.utc),
                            bytes=1 << 30, seconds=4.5)
    now[0] = 1.0  # within the interval: a step report would wait, a new checkpoint does not
    reporter(_report("training", 2).model_copy(update={"checkpoint": ckpt, "resumed_from": 1}))
    now[0] = 2.0
    reporter(_report("training", 3).model_copy(update={"checkpoint": ckpt}))  # nothing new: paced again
    assert len(sent) == 2 and sent[1]["status"]["checkpoint"]["step"] == 2
    assert [p["status"]["progress"]["attempt"] for p in sent] == [2, 2]
    assert sent[1]["status"]["progress"]["resumedFrom"] == 1
    # Unset progress fields go as null: a merge patch then deletes what a previous attempt had written.
    assert "resumedFrom" in sent[0]["status"]["progress"] and sent[0]["status"]["progress"]["resumedFrom"] is None


def test_a_failing_api_server_is_counted_not_raised() -> None:
    calls = []

    def patch(body: dict[str, Any]) -> None:
        calls.append(body)
        raise ConnectionRefusedError("api server away")

    reporter = StatusReporter(patch, interval=0)
    reporter(_report("training", 1))
    reporter(_report("failed", 1))
    assert (len(calls), reporter.failed, reporter.sent) == (2, 2, 0)


def _image_argv(dockerfile: Path) -> tuple[list[str], list[str]]:
    """ENTRYPOINT and CMD of the Dockerfile's final stage (exec form), as the image records them."""
    entrypoint: list[str] = []
    cmd: list[str] = []
    for line in dockerfile.read_text().splitlines():
        word, _, rest = line.strip().partition(" ")
        if word.upper() == "FROM":
            entrypoint, cmd = [], []
        elif word.upper() == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif word.upper() == "CMD":
            cmd = json.loads(rest)
    return entrypoint, cmd


def _container_argv(container: dict[str, Any], entrypoint: list[str], cmd: list[str]) -> list[str]:
    """What the kubelet runs: a pod's command replaces ENTRYPOINT (and drops CMD), its args replace CMD."""
    if container.get("command"):
        return list(container["command"]) + list(container.get("args") or [])
    return entrypoint + list(container.get("args") or cmd)


@pytest.mark.parametrize("user_command", [None, ["memstrata", "pod"]])
def test_the_rendered_pod_on_the_runtime_image_runs_the_runtime(tmp_path: Path, user_command: Any) -> None:
    """The pod as the operator renders it, started the way the kubelet starts the runtime image,
    reaches `memstrata pod`, which reads the mounted config (and, with no API server to report to,
    says so by the job's name)."""
    job = load_job(TINY)
    plan = plan_job(job.spec, local_inventory(tmp_path / "nvme"))
    spec = job.spec.wire() | ({"command": user_command} if user_command else {})
    body = {"metadata": {"name": job.metadata.name, "namespace": "team-a", "uid": "u-1"}, "spec": spec}
    companions, (pod,) = gang_objects(job_view(body), ("node-1",), plan, attempt=0)
    (container,) = pod["spec"]["containers"]
    argv = _container_argv(container, *_image_argv(REPO / "docker" / "runtime.Dockerfile"))

    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "runtime-config")
    cm = next(o for o in companions if o["kind"] == "ConfigMap")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    for var in container["env"]:  # the mount point moved into tmp_path, as the kubelet mounts the ConfigMap
        env[var["name"]] = var["value"].replace(mount, str(tmp_path / "config"))
    for key, text in cm["data"].items():
        (tmp_path / "config").mkdir(exist_ok=True)
        (tmp_path / "config" / key).write_text(text)
    env.update(KUBECONFIG=str(tmp_path / "no-kubeconfig"), HOME=str(tmp_path),
               MEMSTRATA_SCRATCH=str(tmp_path / "scratch"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, (argv, proc.stderr)
    assert "no Kubernetes credentials to report into FineTuneJob team-a/finetune-tiny" in proc.stderr, proc.stderr


def test_no_credentials_and_an_unusable_scratch_are_named(tmp_path: Path) -> None:
    path = rendered_config(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    env.update(MEMSTRATA_RUNTIME_CONFIG=str(path), KUBECONFIG=str(tmp_path / "no-kubeconfig"),
               HOME=str(tmp_path), MEMSTRATA_SCRATCH=str(tmp_path / "scratch"))
    proc = subprocess.run([sys.executable, "-m", "memstrata.cli", "pod"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no Kubernetes credentials to report into FineTuneJob team-a/finetune-tiny" in proc.stderr
    assert "Traceback" not in proc.stderr

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env["MEMSTRATA_SCRATCH"] = str(blocker / "scratch")
    proc = subprocess.run([sys.executable, "-m", "memstrata.cli", "pod"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and f"{blocker}/scratch: cannot create it" in proc.stderr, proc.stderr


def test_every_spec_field_reaches_the_pods_job(tmp_path: Path) -> None:
    """The config carries the spec whole: every field the job sets — volumes, image, run policy, checkpoint,
    output, as well as training and memory — is the pod's job's, with nothing listed field by field."""
    extra = {"checkpoint": {"path": "/data/ckpt", "everySteps": 5, "keep": 2},
             "volumes": [{"name": "data", "emptyDir": {}}], "volumeMounts": [{"name": "data", "mountPath": "/data"}],
             "image": "registry.example/runtime:7", "command": ["memstrata", "pod"],
             "runPolicy": {"backoffLimit": 1}}
    path = rendered_config(tmp_path, **extra)
    job, _ = job_and_plan(load_config(path))
    want = FineTuneJobSpec.model_validate({**load_job(TINY).spec.wire(), **extra})
    assert job.spec == want and json.loads(path.read_text())["spec"] == want.wire()
    # Not a copy field by field: a field added to FineTuneJobSpec reaches the pod without touching the config.
    assert RuntimeConfig.model_fields["spec"].annotation is FineTuneJobSpec


def test_a_config_of_the_previous_operator_is_refused_naming_its_version(tmp_path: Path) -> None:
    """The operator and the runtime image come from one chart release: a pod left from before an upgrade says so
    instead of misreading the old split fields."""
    path = rendered_config(tmp_path)
    data = json.loads(path.read_text())
    spec = data.pop("spec")
    old = {**data, "version": "memstrata.dev/runtime-config/v1",
           **{k: spec[k] for k in ("model", "dataset", "training", "resources", "memory")}}
    path.write_text(json.dumps(old))
    with pytest.raises(PodConfigError, match=rf"^{path}: version 'memstrata.dev/runtime-config/v1' was written by an "
                                             r"earlier memstrata operator; this runtime image reads "
                                             r"'memstrata.dev/runtime-config/v2' only .*upgrade the operator"):
        load_config(path)
