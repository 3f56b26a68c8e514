"""The pure logic of the offload-at-every-budget benchmark (benchmarks/offload): cap arithmetic, /proc/diskstats
parsing, cgroup file handling, step statistics, best-stock selection, bounds and the targets table."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "offload"
sys.path.insert(0, str(BENCH))

import budget  # noqa: E402
import diskstats  # noqa: E402
from budget_md import markdown  # noqa: E402
from memcap import DramCap, keyed  # noqa: E402

G = 1 << 30


def test_caps_are_base_plus_bytes_per_param_with_the_all_fits_cap_last() -> None:
    caps = budget.caps(1000, 100, [16, 2.2, 8])
    assert [(c["k"], c["bytes"], c["all_fits"]) for c in caps] == [
        (2.2, 1220, False), (8, 1800, False), (16, 2600, False), (20.0, 3000, True)]


DISKSTATS = """\
   7       0 loop0 10 0 2048 5 3 0 4096 1 0 0 0 0 0 0 0 0 0
 254       0 vda 5137799 1460388 6275538595 44052752 3208432 1918506 6278747661 19415784 0 4051728 63704013
 254       1 vda1 1 0 8 0 1 0 16 0 0 0 0
"""


def test_diskstats_counts_sectors_of_512_bytes_read_and_written() -> None:
    got = diskstats.parse(DISKSTATS)
    assert got["loop0"] == (2048 * 512, 4096 * 512)
    assert got["vda"] == (6275538595 * 512, 6278747661 * 512)
    assert got["vda1"] == (8 * 512, 16 * 512)


def test_diskstats_snapshot_and_deltas_per_device(tmp_path: Path) -> None:
    f = tmp_path / "diskstats"
    f.write_text(DISKSTATS)
    before = diskstats.snapshot(["vda", "loop0", "nvme9n1"], f)
    assert set(before) == {"vda", "loop0"}  # an absent device is absent, not zero
    after = {"vda": (before["vda"][0] + 4096, before["vda"][1] + (1 << 20)), "loop0": before["loop0"]}
    assert diskstats.deltas(before, after) == {"vda": [4096, 1 << 20], "loop0": [0, 0]}


def test_device_of_resolves_the_block_device_under_a_path(tmp_path: Path) -> None:
    st = os.stat(tmp_path)
    sys_block = tmp_path / "sys-dev-block"
    (tmp_path / "devices" / "vdz").mkdir(parents=True)
    sys_block.mkdir()
    (sys_block / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}").symlink_to(tmp_path / "devices" / "vdz")
    assert diskstats.device_of(tmp_path, sys_block) == "vdz"
    with pytest.raises(FileNotFoundError, match="no block device"):
        diskstats.device_of(tmp_path, tmp_path / "devices")


def test_step_io_is_the_median_over_measured_steps_only() -> None:
    steps = [{"vda": [10**9, 10**9]}, {"vda": [100, 10]}, {"vda": [300, 30]}, {"vda": [200, 20]}]
    assert budget.step_io(steps, "vda", warmup=1) == {"read_bytes": 200, "write_bytes": 20}
    assert budget.step_io(steps, "loop0", warmup=1) is None


def test_cgroup_v2_parsing_on_a_fake_tree_only(tmp_path: Path) -> None:
    """The real v2 path runs on machines with a unified hierarchy; here only its files, in a fake tree."""
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    cap, why = DramCap.open("t", 3 * G, root=tmp_path)
    assert cap is not None and cap.version == 2, why
    assert (cap.path / "memory.max").read_text() == str(3 * G)
    assert (cap.path / "memory.swap.max").read_text() == "0"
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory"
    assert cap.peak_bytes() is None  # a kernel without memory.peak
    (cap.path / "memory.peak").write_text("123456\n")
    (cap.path / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 0\n")
    assert cap.peak_bytes() == 123456 and not cap.oom_killed()
    (cap.path / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 3\noom_kill 1\noom_group_kill 0\n")
    assert cap.oom_killed()


def test_cgroup_open_says_why_when_neither_version_is_there(tmp_path: Path) -> None:
    cap, why = DramCap.open("t", G, root=tmp_path)
    assert cap is None
    assert "no cgroup v2 memory controller" in why and "no cgroup v1 memory controller" in why


def test_cgroup_v1_oom_control_parsing() -> None:
    assert keyed("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")["oom_kill"] == 3


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists()
                    or (Path("/sys/fs/cgroup/cgroup.controllers").exists()), reason="needs root and cgroup v1")
def test_cgroup_v1_cap_really_kills_a_process_over_it() -> None:
    code = "b = bytearray({n}); b[::4096] = b'x' * len(b[::4096])"
    cap, why = DramCap.open("test-v1", 64 << 20)
    assert cap is not None and cap.version == 1, why
    try:
        small = subprocess.run([sys.executable, "-c", code.format(n=8 << 20)], preexec_fn=cap.preexec)
        assert small.returncode == 0 and not cap.oom_killed()
        assert (cap.peak_bytes() or 0) > 8 << 20
        big = subprocess.run([sys.executable, "-c", code.format(n=256 << 20)], preexec_fn=cap.preexec)
        assert big.returncode == -9 and cap.oom_killed()
    finally:
        cap.close()
    assert not cap.path.exists()


def test_spread_has_median_quartiles_and_extremes() -> None:
    s = budget.spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s == {"n": 5, "median": 3.0, "min": 1.0, "p25": 2.0, "p75": 4.0, "max": 5.0}
    assert budget.spread([2.0])["p75"] == 2.0
    with pytest.raises(ValueError):
        budget.spread([])


def _run(name: str, step: float | None, rss: int = G, io: tuple[int, int] | None = None, **kw: Any) -> dict[str, Any]:
    if step is None:
        return {"contender": name, "ok": False, "peak_rss_bytes": rss, **kw}
    r: dict[str, Any] = {"contender": name, "ok": True, "step": budget.spread([step]), "peak_rss_bytes": rss,
                         "phases": {"forward": 1.0, "backward": 1.0, "update": 1.0}, "init_seconds": 1.0}
    if io:
        r["io"] = {"vda": {"read_bytes": io[0], "write_bytes": io[1]}}
    return {**r, **kw}


def test_best_stock_is_the_fastest_finished_stock_run() -> None:
    runs = [_run("memstrata", 1.0), _run("stock-default", None, oom_killed=True), _run("stock-tuned", 5.0),
            _run("stock-cpu", 3.0)]
    assert budget.best_stock(runs)["contender"] == "stock-cpu"  # type: ignore[index]
    assert budget.best_stock([_run("memstrata", 1.0), _run("stock-cpu", None, skipped=True)]) is None


def _model(ours: list[float | None], tuned: list[float | None], cpu_fits: float | None, ours_fits: float | None,
           rss: int = G) -> dict[str, Any]:
    caps = []
    for k, o, t in zip((2.2, 8, 16), ours, tuned):
        caps.append({"k": k, "bytes": 0, "all_fits": False,
                     "runs": [_run("memstrata", o, rss, io=(1 << 30, 1 << 29)), _run("stock-tuned", t, 4 * G)]})
    caps.append({"k": 20, "bytes": 0, "all_fits": True,
                 "runs": [_run("memstrata", ours_fits, rss), _run("stock-cpu", cpu_fits, 2 * G)]})
    return {"caps": caps}


FIO = {"read_bytes_per_s": float(1 << 30), "write_bytes_per_s": float(1 << 29)}


def test_bound_is_io_over_fio_bandwidth_plus_the_compute_floor() -> None:
    m = budget.summarize_model(_model([3.0, 3.0, 3.0], [10.0] * 3, 1.5, 1.0), FIO, "vda")
    assert m["compute_floor"] == {"seconds": 1.0, "from": "memstrata"}
    b = m["caps"][0]["runs"][0]["bound"]
    assert b["io_seconds"] == 2.0 and b["seconds"] == 3.0 and b["ratio"] == 1.0
    assert m["caps"][0]["best_stock"] == "stock-tuned"
    assert m["caps"][0]["vs_best_stock"] == {"step_ratio": 0.3, "memory_ratio": 0.25}


def _verdicts(m: dict[str, Any]) -> list[bool | None]:
    return [t["pass"] for t in budget.summarize_model(m, FIO, "vda")["targets"]]


def test_targets_pass_when_every_ratio_is_met() -> None:
    assert _verdicts(_model([3.0, 3.0, 3.0], [10.0] * 3, 1.0, 1.0)) == [True] * 6


def test_targets_fail_on_oom_slow_steps_and_memory() -> None:
    oom = _model([None, 3.0, 3.0], [10.0] * 3, 1.0, 1.0)
    oom["caps"][0]["runs"][0]["oom_killed"] = True
    assert _verdicts(oom)[0] is False
    slow = _verdicts(_model([3.0, 3.0, 9.0], [10.0] * 3, 1.0, 1.0))
    assert slow[1] is False and slow[2] is False  # 9 s vs bound 3 s; 9 s vs stock 10 s > 0.6x
    fat = _verdicts(_model([3.0, 3.0, 3.0], [10.0] * 3, 1.0, 1.0, rss=2 * G))
    assert fat[3] is False and fat[5] is False  # 2 GiB vs tuned's 4 GiB (> 0.40x); vs cpu's 2 GiB (> 0.75x)
    cpu_faster = _verdicts(_model([3.0, 3.0, 3.0], [10.0] * 3, 0.8, 1.0))
    assert cpu_faster[4] is False  # stock CPU 0.8 s vs memstrata 1.0 s: 0.8x speed


def test_targets_are_not_measurable_without_the_runs_they_compare() -> None:
    m = _model([3.0, 3.0, 3.0], [None] * 3, None, None)
    v = _verdicts(m)
    assert v[1] is None  # no all-DRAM run finished: no compute floor, so no bound to hold memstrata to
    assert m["caps"][0]["runs"][0]["bound"]["includes_floor"] is False
    assert v[3] is None and v[4] is None and v[5] is None


def test_markdown_shows_failures_and_targets() -> None:
    m = budget.summarize_model(_model([None, 3.0, 3.0], [10.0] * 3, 1.0, 1.0), FIO, "vda")
    m["caps"][0]["runs"][0].update(oom_killed=True, error="killed by the OOM killer under the cap")
    m["targets"] = budget.targets(m)
    results = {"machine": {"cores": 2, "scratch": "/x", "scratch_fs": "ext4"}, "fio": FIO, "backing_device": "vda",
               "dram_cap": {"enforced": True, "mechanism": "cgroup v1"}, "seq": 128, "batch": 1, "precision": "bf16",
               "warmup": 2, "measured": 8, "base_formula": budget.BASE_FORMULA, "idle_interpreter_rss_bytes": G,
               "bound_formula": "b", "statistic": "s", "loadavg_start": [0, 0, 0], "models": {"gpt-x": m}}
    md = markdown(results)
    assert "| gpt-x | 2.2 |" in md and "OOM: killed by the OOM killer" in md
    assert "memstrata never OOMs" in md and "| FAIL |" in md
