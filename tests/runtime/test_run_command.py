"""`memstrata run`: a real fine-tune through stock DeepSpeed ZeRO-Infinity, and its refusals.

The bad-input cases run the real CLI and check the user's view: exit status 2,
one line on stderr naming the problem, nothing written. The fine-tune itself
(marked slow) runs the tiny example end to end and watches the swap directory
from outside while it runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "finetune-tiny.yaml"


def _job(tmp_path: Path, **spec_changes: object) -> Path:
    doc = yaml.safe_load(TINY.read_text())
    for dotted, value in spec_changes.items():
        node = doc["spec"]
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memstrata.cli", "run", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _assert_refused(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == ""


def _listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_missing_model_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    job = _job(tmp_path, model={"path": str(missing), "architecture": {
        "family": "llama", "layers": 2, "hidden": 64, "intermediate": 128, "heads": 4, "kvHeads": 2, "vocab": 300}})
    nvme = tmp_path / "nvme"
    _assert_refused(_run(str(job), "--nvme-path", str(nvme)), "spec.model.path", str(missing), "no such directory")
    assert not nvme.exists()


def test_missing_dataset_file(tmp_path: Path) -> None:
    missing = tmp_path / "none.jsonl"
    job = _job(tmp_path, dataset={"path": str(missing)})
    nvme = tmp_path / "nvme"
    _assert_refused(_run(str(job), "--nvme-path", str(nvme)), "spec.dataset.path", str(missing), "no such file")
    assert not nvme.exists()


def test_a_dataset_glob_that_matches_nothing_is_refused_before_anything_starts(tmp_path: Path) -> None:
    pattern = str(tmp_path / "shards" / "*.parquet")
    job = _job(tmp_path, dataset={"mix": [{"path": pattern, "weight": 1}, {"path": str(TINY), "weight": 1}]})
    nvme = tmp_path / "nvme"
    _assert_refused(_run(str(job), "--nvme-path", str(nvme)), "spec.dataset.mix[0].path", pattern, "matches no file")
    assert not nvme.exists()


@pytest.mark.slow
def test_the_report_says_where_the_optimizer_state_went_as_the_init_line_does(tmp_path: Path) -> None:
    """memstrata's engine with every byte in DRAM: DeepSpeed is configured with its swapper (device nvme), but
    the state is in DRAM and NVMe stays empty, so both the init line and the report say cpu."""
    job = _job(tmp_path, memory__dramBudget="1Gi", training__steps=2)
    nvme, report = tmp_path / "nvme", tmp_path / "report.json"
    nvme.mkdir()
    proc = _run(str(job), "--nvme-path", str(nvme), "--report-json", str(report), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = " ".join((proc.stdout + proc.stderr).split())
    assert "(weights -> cpu, optimizer state -> cpu)" in said, said
    assert "weights -> cpu, optimizer state -> cpu" in said.split("engine", 1)[1], said
    r = json.loads(report.read_text())
    assert r["offload"] == {"param": "cpu", "optimizer": "cpu"} and r["strata"]["nvme"]["peak_bytes"] == 0


def test_malformed_jsonl_line_names_file_and_line(tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "a fine first record " * 20}) + "\n" + '{"text": "broken\n')
    job = _job(tmp_path, dataset={"path": str(data)})
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    report = tmp_path / "report.json"
    proc = _run(str(job), "--nvme-path", str(nvme), "--report-json", str(report))
    _assert_refused(proc, f"{data}:2:", "malformed JSON")
    assert _listing(nvme) == [] and not report.exists()


def test_nvme_path_under_a_file_is_unwritable(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    nvme = blocker / "scratch"
    _assert_refused(_run(str(TINY), "--nvme-path", str(nvme)), str(nvme), "not writable")
    assert blocker.read_text() == "not a directory"


def test_nvme_path_on_a_read_only_filesystem(tmp_path: Path) -> None:
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a read-only mount needs root; not root here")
    # A read-only bind mount of a directory on disk: root can write through permissions, not through this.
    src = tmp_path / "src"
    src.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(mnt)]).returncode != 0:
        pytest.skip("cannot bind-mount here (mount --bind failed); read-only case not exercised")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(mnt)]).returncode != 0:
            pytest.skip("cannot remount read-only here; read-only case not exercised")
        _assert_refused(_run(str(TINY), "--nvme-path", str(mnt)), str(mnt), "not writable", "Read-only")
        assert _listing(src) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_nvme_path_on_tmpfs_is_refused_and_left_clean() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("/dev/shm does not exist on this machine; tmpfs case not exercised")
    nvme = shm / f"memstrata-test-{os.getpid()}"
    proc = _run(str(TINY), "--nvme-path", str(nvme))
    try:
        _assert_refused(proc, str(nvme), "tmpfs", "disk filesystem")
        assert not nvme.exists(), "a refused run must not leave its scratch directory behind"
    finally:
        if nvme.exists():
            nvme.rmdir()


@pytest.mark.slow
def test_tiny_example_fine_tunes_through_nvme(tmp_path: Path) -> None:
    """The tiny example on stock ZeRO-Infinity (`memory.engine: deepspeed`), the baseline path: its swap
    files must appear on the NVMe stratum while it runs (tests/offload covers the memstrata engine)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: run `make install`")
    job = _job(tmp_path, memory__engine="deepspeed")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    report_path = tmp_path / "report.json"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "memstrata.cli", "run", str(job), "--nvme-path", str(nvme),
                             "--report-json", str(report_path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    # Watch the swap directory from outside while the run goes on.
    seen_files: set[str] = set()
    while proc.poll() is None and time.monotonic() - started < 600:
        try:
            seen_files.update(p.name for p in nvme.rglob("*") if p.is_file() and p.stat().st_size > 0)
        except FileNotFoundError:  # the run removed a file or its directory while this walked it
            pass
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate()
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, err[-3000:]
    assert elapsed <= 300, f"the tiny example took {elapsed:.0f} s, more than 5 minutes"
    assert "built successfully" not in out + err, "DeepSpeed's op-build chatter reached the run's output"

    swap_names = [n for n in seen_files if n.endswith(".swp") or "tensor" in n]
    assert swap_names, f"no swap files seen under {nvme} while running: {sorted(seen_files)[:10]}"
    assert _listing(nvme) == [], "the per-run swap directory is removed afterwards"

    r = json.loads(report_path.read_text())
    assert r["offload"] == {"param": "nvme", "optimizer": "nvme"}
    assert r["steps"] == len(r["losses"]) >= 10
    assert r["loss"]["last_mean"] <= 0.8 * r["loss"]["first_mean"], r["loss"]
    assert r["strata"]["nvme"]["bytes_written"] > 0 and r["strata"]["nvme"]["bytes_read"] >= 0
    assert r["strata"]["nvme"]["peak_bytes"] > 0 and r["swap_files"] > 0
    assert r["peak_rss_bytes"] > 50 << 20, "the process tree's RSS includes torch itself"
    assert set(r["phases"]) == {"init", "forward", "backward", "step", "total"}
    assert all(v > 0 for v in r["phases"].values())
    assert {"zero_optimization.offload_param.buffer_size", "zero_optimization.sub_group_size"} <= {
        s["key"] for s in r["deepspeed_settings"]}
    # The printed report says the same.
    assert "first 5 steps" in out and "nvme" in out and "forward" in out and "backward" in out
