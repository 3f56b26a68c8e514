"""`memory.engine: deepspeed` never swaps silently to the wrong place: stock DeepSpeed writes files under
`nvme_path`, so a job whose NVMe stratum is raw namespaces (or, in a pod, nothing but the container's root
filesystem) is refused at once with the field named, before a byte is written."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memstrata.api import load_job
from memstrata.api.finetunejob import FineTuneJobSpec
from memstrata.api.strataplan import Plan
from memstrata.node.local import local_inventory
from memstrata.operator.observe import job_view
from memstrata.operator.render import gang_objects
from memstrata.plan import plan_job
from memstrata.runtime.train import pod
from memstrata.runtime.train.dsconfig import deepspeed_swap_refusal
from memstrata.runtime.train.recipe import FineTuneRecipe, RecipeError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "finetune-tiny.yaml"
NAMESPACES = "/dev/nvme1n1,/dev/nvme2n1"


def _spec(engine: str, **memory: object) -> FineTuneJobSpec:
    spec = load_job(TINY).spec
    return spec.model_copy(update={"memory": spec.memory.model_copy(update={"engine": engine, **memory})})


def _plan(spec: FineTuneJobSpec, tmp_path: Path) -> Plan:
    return plan_job(spec, local_inventory(tmp_path / "nvme"))


def test_only_deepspeed_with_nvme_in_its_plan_is_refused_and_the_reason_names_the_field(tmp_path: Path) -> None:
    spilled = _plan(_spec("deepspeed"), tmp_path)  # dramBudget 8Mi: weights and optimizer state on NVMe
    assert spilled.offload_device("weights") == spilled.offload_device("master", "optimizer") == "nvme"
    swap = Path("/var/tmp/memstrata")

    granted = deepspeed_swap_refusal(spilled, granted=NAMESPACES.split(","), swap_dir=swap, swap_dir_on_root=False)
    assert granted == spilled.stock_swap_refusal() and granted is not None and granted.startswith(
        "spec.memory.engine: deepspeed cannot swap the parameters and optimizer state the plan puts on NVMe to raw "
        "namespaces: stock DeepSpeed writes what it offloads as files under a directory (nvme_path)")
    assert "memory.engine: memstrata" in granted

    on_root = deepspeed_swap_refusal(spilled, granted=[], swap_dir=swap, swap_dir_on_root=True)
    assert on_root is not None and on_root.startswith(
        f"spec.memory.engine: deepspeed would swap the parameters and optimizer state the plan puts on NVMe to "
        f"{swap}, on the container's root filesystem")

    # A scratch volume of its own (a local run's --nvme-path) is where the user asked DeepSpeed to swap.
    assert deepspeed_swap_refusal(spilled, granted=[], swap_dir=swap, swap_dir_on_root=False) is None
    # memstrata's engine writes the namespaces itself; a CPU-offload plan writes no swap file at all.
    assert deepspeed_swap_refusal(_plan(_spec("memstrata"), tmp_path), granted=["/dev/nvme1n1"], swap_dir=swap,
                                  swap_dir_on_root=True) is None
    in_dram = _plan(_spec("deepspeed", nvme_namespaces=0, dram_budget=None), tmp_path)
    assert in_dram.feasible and in_dram.offload_device("weights", "master", "optimizer") == "cpu"
    assert deepspeed_swap_refusal(in_dram, granted=["/dev/nvme1n1"], swap_dir=swap, swap_dir_on_root=True) is None


def test_root_filesystem_is_told_from_a_mounted_one() -> None:
    assert pod.on_root_filesystem(Path("/"))
    assert not pod.on_root_filesystem(Path("/proc"))  # procfs: another filesystem, as a volume would be
    assert not pod.on_root_filesystem(Path("/proc/no/such/dir"))  # not there yet: its nearest parent decides


def _rendered_deepspeed_config(tmp_path: Path) -> Path:
    spec = _spec("deepspeed")
    body = {"metadata": {"name": "ds-job", "namespace": "team-a", "uid": "u-1"}, "spec": spec.wire()}
    companions, _ = gang_objects(job_view(body), ("node-1",), _plan(spec, tmp_path), attempt=0)
    cm = next(o for o in companions if o["kind"] == "ConfigMap")
    path = tmp_path / "runtime-config.json"
    path.write_text(cm["data"]["runtime-config.json"])
    assert json.loads(path.read_text())["spec"]["memory"]["engine"] == "deepspeed"
    return path


@pytest.mark.parametrize("granted", [True, False], ids=["namespaces-granted", "root-filesystem"])
def test_the_pod_refuses_before_training_and_says_why_in_its_termination_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], granted: bool) -> None:
    config = _rendered_deepspeed_config(tmp_path)
    termination = tmp_path / "termination-log"
    monkeypatch.setattr(pod, "TERMINATION_LOG", termination)
    if granted:
        monkeypatch.setenv("MEMSTRATA_NVME_DEVICES", NAMESPACES)
    else:
        monkeypatch.delenv("MEMSTRATA_NVME_DEVICES", raising=False)
        monkeypatch.setattr(pod, "on_root_filesystem", lambda path: True)  # the container's writable layer
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    patches: list[dict[str, object]] = []
    rc = pod.run_pod(scratch, config_path=str(config), patcher=lambda ref: patches.append)
    assert rc == pod.EXIT_USAGE
    expected = ("deepspeed cannot swap the parameters and optimizer state the plan puts on NVMe to raw namespaces"
                if granted
                else f"deepspeed would swap the parameters and optimizer state the plan puts on NVMe to {scratch}, "
                     "on the container's root filesystem")
    assert termination.read_text().startswith(f"error: spec.memory.engine: {expected}")
    assert expected in capsys.readouterr().err
    assert list(scratch.iterdir()) == []  # refused before the recipe made its swap directory


def test_a_local_run_refuses_granted_namespaces_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = load_job(TINY)
    job = job.model_copy(update={"spec": _spec("deepspeed")})
    plan = _plan(job.spec, tmp_path)
    monkeypatch.setenv("MEMSTRATA_NVME_DEVICES", "/dev/nvme1n1")
    with pytest.raises(RecipeError) as refused:
        FineTuneRecipe(job, plan, tmp_path / "scratch")
    assert str(refused.value) == plan.stock_swap_refusal()
    monkeypatch.delenv("MEMSTRATA_NVME_DEVICES")
    FineTuneRecipe(job, plan, tmp_path / "scratch")  # the scratch directory the user gave: the baseline's own


def test_the_refusal_says_the_same_in_the_pod_and_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One statement of why stock DeepSpeed cannot use raw namespaces (Plan.stock_swap_refusal): the pod's
    termination message and a local run's error are it, word for word, as the operator's placement is
    (tests/operator/test_node_selection.py)."""
    spec = _spec("deepspeed")
    plan = _plan(spec, tmp_path)
    words = plan.stock_swap_refusal()
    assert words is not None

    monkeypatch.setenv("MEMSTRATA_NVME_DEVICES", NAMESPACES)
    termination = tmp_path / "termination-log"
    monkeypatch.setattr(pod, "TERMINATION_LOG", termination)
    (tmp_path / "scratch").mkdir()
    assert pod.run_pod(tmp_path / "scratch", config_path=str(_rendered_deepspeed_config(tmp_path)),
                       patcher=lambda ref: lambda body: None) == pod.EXIT_USAGE
    assert termination.read_text() == f"error: {words}"

    with pytest.raises(RecipeError) as refused:
        FineTuneRecipe(load_job(TINY).model_copy(update={"spec": spec}), plan, tmp_path / "run")
    assert str(refused.value) == words
