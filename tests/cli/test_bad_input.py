"""Bad input a user would really produce: one line naming the field or path, exit 2, nothing written."""
from __future__ import annotations

from pathlib import Path

import pytest

GOOD = """apiVersion: memstrata.dev/v1alpha1
kind: FineTuneJob
metadata: {name: t}
spec:
  model: {preset: gpt-tiny}
  dataset: {synthetic: copy}
  training: {steps: 4, sequenceLength: 64}
"""

CASES = {
    "malformed-yaml": (GOOD.replace("{preset: gpt-tiny}", "{preset: gpt-tiny"), "malformed YAML at line"),
    "top-level-list": ("- " + GOOD.replace("\n", "\n  "), "expected a mapping at the top level, got a list"),
    "spec-is-a-list": (GOOD.split("spec:")[0] + "spec: [model, dataset]\n", "spec: Input should be a valid dictionary"),
    "unknown-field": (GOOD.replace("steps: 4", "stepz: 4, steps: 4"), "spec.training.stepz: unknown field"),
    # A misspelt field is two problems; the unknown name comes first, and neither hides behind a count.
    "misspelt-field": (GOOD.replace("steps: 4", "stepz: 4"),
                       "spec.training.stepz: unknown field"),
    "wrong-type": (GOOD.replace("steps: 4", "steps: many"), "spec.training.steps: Input should be a valid integer"),
    "negative-steps": (GOOD.replace("steps: 4", "steps: -5"),
                       "spec.training.steps: Input should be greater than or equal to 0 (got -5)"),
    # A typo that would otherwise be planned, placed and shown with an ETA of 31 billion hours.
    "absurd-steps": (GOOD.replace("steps: 4", "steps: 1000000000000000000000"),
                     "spec.training.steps: Input should be less than or equal to 10000000 "
                     "(got 1000000000000000000000)"),
    "absurd-micro-batch": (GOOD.replace("steps: 4", "steps: 4, microBatch: 100000000"),
                           "spec.training.microBatch: Input should be less than or equal to 65536"),
    "two-model-sources": (GOOD.replace("{preset: gpt-tiny}", "{preset: gpt-tiny, path: /m}"),
                          "spec.model: set exactly one of model.preset or model.path"),
    # Valid without an architecture: the shape is then read from the directory, which is not there.
    "path-without-architecture": (GOOD.replace("{preset: gpt-tiny}", "{path: /models/x}"),
                                  "spec.model.path: /models/x: no such directory"),
    "mount-of-no-volume": (GOOD + "  volumes: [{name: data, emptyDir: {}}]\n"
                                  "  volumeMounts: [{name: models, mountPath: /models}]\n",
                           "spec: volumeMounts[0].name: 'models' is not one of spec.volumes (data)"),
    "operators-volume-name": (GOOD + "  volumes: [{name: runtime-config, emptyDir: {}}]\n",
                              "spec.volumes[0]: name 'runtime-config' is the operator's own volume"),
    "operators-mount-path": (GOOD + "  volumes: [{name: data, emptyDir: {}}]\n"
                                    "  volumeMounts: [{name: data, mountPath: /etc/memstrata/x}]\n",
                             "spec.volumeMounts[0]: mountPath /etc/memstrata/x: must not be at or under /etc/memstrata"),
    "volume-twice": (GOOD + "  volumes: [{name: data, emptyDir: {}}, {name: data, hostPath: {path: /d}}]\n",
                     "spec: volumes[1].name: 'data' is given twice"),
    "unknown-preset": (GOOD.replace("gpt-tiny", "gpt-5"), "spec.model.preset: unknown preset 'gpt-5' (known: gpt-tiny,"),
    "too-long-for-preset": (GOOD.replace("sequenceLength: 64", "sequenceLength: 4096"),
                            "exceeds the model's 512 positions"),
    "wrong-kind": (GOOD.replace("kind: FineTuneJob", "kind: PyTorchJob"), "kind: expected FineTuneJob, got 'PyTorchJob'"),
    "bad-quantity": (GOOD + "  memory: {pinnedMemoryCap: lots}\n",
                     "spec.memory.pinnedMemoryCap: Value error, expected a byte quantity like 512Gi"),
    "empty-file": ("", "empty file"),
    "lora-block-with-method-full": (GOOD.replace("steps: 4,", "steps: 4, lora: {rank: 4},"),
                                    "spec.training: training.lora is only for training.method: lora"),
    "lora-rank-zero": (GOOD.replace("steps: 4,", "steps: 4, method: lora, lora: {rank: 0},"),
                       "spec.training.lora.rank: Input should be greater than 0 (got 0)"),
    "lora-dropout-one": (GOOD.replace("steps: 4,", "steps: 4, method: lora, lora: {dropout: 1},"),
                         "spec.training.lora.dropout: Input should be less than 1 (got 1)"),
    "lora-unknown-target": (GOOD.replace("steps: 4,", "steps: 4, method: lora, lora: {targetModules: [q_proj]},"),
                            "training.lora.targetModules: q_proj: not a linear module of a GPT-2 model's layers "
                            "(those that take adapters: c_attn, c_proj, c_fc)"),
}


def _assert_one_line_exit_2(result, expect: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expect in lines[0], lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["plan", "run"])
def test_bad_manifest(cli, tmp_path: Path, case: str, command: str) -> None:
    text, expect = CASES[case]
    manifest = tmp_path / "job.yaml"
    manifest.write_text(text)
    scratch = tmp_path / "nvme"
    result = cli(command, str(manifest), "--nvme-path", str(scratch))
    _assert_one_line_exit_2(result, expect.replace("Value error, ", ""))
    assert str(manifest) in result.stderr
    assert not scratch.exists(), "a refused job must not create its NVMe scratch directory"


def test_missing_file(cli, tmp_path: Path) -> None:
    _assert_one_line_exit_2(cli("plan", str(tmp_path / "nope.yaml")), "nope.yaml: no such file")


def _job(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_missing_model_directory(cli, tmp_path: Path) -> None:
    job = _job(tmp_path, GOOD.replace("{preset: gpt-tiny}", "{path: /models/absent, architecture: {layers: 2, "
                                      "hidden: 64, intermediate: 256, heads: 4, kvHeads: 4, vocab: 300}}"))
    result = cli("run", str(job), "--nvme-path", str(tmp_path / "nvme"))
    _assert_one_line_exit_2(result, "spec.model.path: /models/absent: no such directory")
    assert not (tmp_path / "nvme").exists()


def test_missing_dataset_file(cli, tmp_path: Path) -> None:
    job = _job(tmp_path, GOOD.replace("{synthetic: copy}", "{path: /data/absent.jsonl}"))
    _assert_one_line_exit_2(cli("run", str(job)), "spec.dataset.path: /data/absent.jsonl: no such file")


@pytest.mark.parametrize("nvme_path,expect", [
    ("/proc/memstrata-nvme", "/proc/memstrata-nvme: NVMe scratch path is not writable"),
    ("/sys/memstrata-nvme", "/sys/memstrata-nvme: NVMe scratch path is not writable"),
    ("/dev/shm/memstrata-nvme", "is on tmpfs, which lives in RAM; use a disk filesystem"),
])
def test_unusable_nvme_path(cli, tmp_path: Path, nvme_path: str, expect: str) -> None:
    if nvme_path.startswith("/dev/shm") and not Path("/dev/shm").is_dir():
        pytest.skip("this machine has no /dev/shm tmpfs to try")
    result = cli("run", str(_job(tmp_path, GOOD)), "--nvme-path", nvme_path)
    _assert_one_line_exit_2(result, expect)


def test_nvme_path_under_a_file(cli, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    result = cli("run", str(_job(tmp_path, GOOD)), "--nvme-path", str(tmp_path / "afile/nvme"))
    _assert_one_line_exit_2(result, "afile/nvme: NVMe scratch path is not writable: Not a directory")


def test_impossible_plan_is_refused(cli, tmp_path: Path, repo: Path) -> None:
    job = _job(tmp_path, GOOD.replace("gpt-tiny", "llama3-70b").replace("sequenceLength: 64", "sequenceLength: 8192")
               + "  memory: {nvmeNamespaces: 0}\n")
    plan = cli("plan", str(job), "--node", str(repo / "examples/node-cxl.yaml"))
    assert plan.returncode == 2
    assert "verdict: does not fit" in plan.stdout
    assert "DRAM or NVMe: short by" in plan.stdout and "for Adam moments" in plan.stdout
    run = cli("run", str(job), "--nvme-path", str(tmp_path / "nvme"))
    _assert_one_line_exit_2(run, "does not fit on this machine:")
    assert not (tmp_path / "nvme").exists()


def test_bad_node_file(cli, tmp_path: Path, repo: Path) -> None:
    node = tmp_path / "node.yaml"
    node.write_text("kind: NodeInventory\nnumaNodes: [{id: 0, memoryBytes: -1}]\n")
    result = cli("plan", str(repo / "examples/finetune.yaml"), "--node", str(node))
    _assert_one_line_exit_2(result, "numaNodes[0].memoryBytes")


def test_nonpositive_steps_override(cli, tmp_path: Path) -> None:
    _assert_one_line_exit_2(cli("run", str(_job(tmp_path, GOOD)), "--steps", "0"), "--steps must be a positive integer")
