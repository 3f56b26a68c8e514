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
    caps = budget.caps(1000, 100, [16, 2.2, 8], all_fits=20.0)
    assert [(c["k"], c["bytes"], c["all_fits"]) for c in caps] == [
        (2.2, 1220, False), (8, 1800, False), (16, 2600, False), (20.0, 3000, True)]


def test_the_all_fits_cap_holds_stock_cpu_offloads_state_with_room() -> None:
    # 16-bit weights and gradients, fp32 gradient partitions, master and two moments: 20 B/param, and room beyond
    assert budget.ALL_FITS_BYTES_PER_PARAM > 2 + 2 + 4 + 4 + 8
    assert budget.caps(1000, 100, [])[-1] == {"k": budget.ALL_FITS_BYTES_PER_PARAM, "all_fits": True,
                                               "bytes": int(1000 + budget.ALL_FITS_BYTES_PER_PARAM * 100)}


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
           rss: int = G, floors: dict[str, list[tuple[float, Any]]] | None = None) -> dict[str, Any]:
    caps = []
    for k, o, t in zip((2.2, 8, 16), ours, tuned):
        caps.append({"k": k, "bytes": 0, "all_fits": False,
                     "runs": [_run("memstrata", o, rss, io=(1 << 30, 1 << 29)), _run("stock-tuned", t, 4 * G)]})
    caps.append({"k": 20, "bytes": 0, "all_fits": True,
                 "runs": [_run("memstrata", ours_fits, rss), _run("stock-cpu", cpu_fits, 2 * G)]})
    m: dict[str, Any] = {"caps": caps, "params": 100, "base_bytes": 1000, "all_fits_k": 20.0}
    if floors is not None:
        m["floors"] = {n: {"probes": [_probe(k, how) for k, how in p]} for n, p in floors.items()}
    return m


def _probe(k: float, how: Any) -> dict[str, Any]:
    """A bisection run at k: True (finished), 'oom', 'enomem', 'refused' or 'crash'."""
    if how is True:
        return {"k": k, **_run("x", 1.0)}
    return {"k": k, "contender": "x", "ok": False, "oom_killed": how == "oom",
            "refused": how == "refused" or None,
            "error": {"oom": "killed by the OOM killer under the cap", "enomem": "MemoryError: Cannot allocate memory",
                      "refused": "planner: the cap cannot hold the job: DRAM short",
                      "crash": "RuntimeError: boom\ntimed out after 900 s"}[how]}


FIO = {"read_bytes_per_s": float(1 << 30), "write_bytes_per_s": float(1 << 29)}


def test_bound_is_max_of_io_and_compute_overlapped_and_their_sum_serial() -> None:
    m = budget.summarize_model(_model([3.0, 3.0, 3.0], [10.0] * 3, 1.5, 1.0), FIO, "vda")
    assert m["compute_floor"] == {"seconds": 1.0, "from": "memstrata"}
    b = m["caps"][0]["runs"][0]["bound"]  # 1 GiB read at 1 GiB/s + 0.5 GiB written at 0.5 GiB/s = 2 s of I/O
    assert b["io_seconds"] == 2.0 and b["overlapped_seconds"] == 2.0 and b["serial_seconds"] == 3.0
    assert b["ratio"] == 1.5 and b["serial_ratio"] == 1.0 and b["io_bound"] is True
    compute_bound = budget.step_bound(4.0, 1.0, 2.5)
    assert compute_bound["overlapped_seconds"] == 2.5 and compute_bound["serial_seconds"] == 3.5
    assert compute_bound["io_bound"] is False and compute_bound["ratio"] == 1.6
    assert budget.step_bound(3.0, 2.0, None)["overlapped_seconds"] == 2.0  # no compute floor: the I/O alone
    assert m["caps"][0]["best_stock"] == "stock-tuned"
    assert m["caps"][0]["vs_best_stock"] == {"step_ratio": 0.3, "memory_ratio": 0.25}


def _bisect(floor: float | None, crash_at: float | None = None, top: float = 20.0,
            crashes: int = 99) -> list[tuple[float, str]]:
    """Drive next_k against a contender that passes at k >= floor (never, if None), crashing at crash_at (its
    first `crashes` runs there)."""
    tried: list[tuple[float, str]] = []
    while (k := budget.next_k(tried, top)) is not None:
        assert len(tried) < 20
        assert k not in [t for t, o in tried if o != "error"], (k, tried)  # only a crash is run again
        crashed = sum(1 for t, o in tried if t == k and o == "error")
        ok = floor is not None and k >= floor
        crash = crash_at is not None and k <= crash_at and crashed < crashes
        tried.append((k, "error" if crash else "ok" if ok else "oom"))
    return tried


@pytest.mark.parametrize("floor", [0.9, 3.3, 7.0, 13.5, 19.0])
def test_bisection_converges_on_the_floor_within_its_resolution(floor: float) -> None:
    tried = _bisect(floor)
    assert tried[0] == (20.0, "ok")  # the all-fits k runs first
    got = budget.floor_of([{"k": k, "ok": o == "ok", "oom_killed": o == "oom"} for k, o in tried], 20.0)
    assert got["status"] == "found" and got["k"] >= floor
    assert got["k"] - got["failing_k"] <= max(budget.FLOOR_RESOLUTION, budget.FLOOR_RELATIVE * got["k"])
    assert got["failing_k"] < floor and len(tried) <= 8


def test_a_contender_that_never_passes_is_above_all_fits_after_one_run() -> None:
    assert _bisect(None) == [(20.0, "oom")]
    got = budget.floor_of([_probe(20.0, "oom")], 20.0)
    assert got["status"] == "above all-fits" and got["k"] is None and "OOM killer" in got["reason"]


def test_a_contender_that_passes_at_every_k_stops_near_zero() -> None:
    tried = _bisect(0.0)
    assert all(o == "ok" for _, o in tried)
    got = budget.floor_of([_probe(k, True) for k, _ in tried], 20.0)
    assert got["status"] == "found" and 0 < got["k"] <= budget.FLOOR_RESOLUTION
    assert got["failing_k"] is None and got["reason"] == "passes at every k tried"


def test_a_crash_twice_at_one_k_stops_the_bisection_and_is_reported_not_read_as_short_of_memory() -> None:
    tried = _bisect(3.0, crash_at=10.0)
    assert tried == [(20.0, "ok"), (10.0, "error"), (10.0, "error")]
    got = budget.floor_of([_probe(20.0, True), _probe(10.0, "crash"), _probe(10.0, "crash")], 20.0)
    assert got["status"] == "error" and got["k"] is None and got["upper_k"] == 20.0
    assert got["reason"] == "stopped at k=10: timed out after 900 s"


def test_a_crash_once_is_run_again_and_the_bisection_goes_on_from_its_retry() -> None:
    """A stock run once died at exit ("terminate called without an active exception") and left its engine with no
    floor: one crash at a k is retried there, and the retry's outcome is the k's."""
    tried = _bisect(3.0, crash_at=10.0, crashes=1)
    assert tried[:3] == [(20.0, "ok"), (10.0, "error"), (10.0, "ok")]
    probes = [{"k": k, "ok": o == "ok", "oom_killed": o == "oom", "error": "crash" if o == "error" else None}
              for k, o in tried]
    got = budget.floor_of(probes, 20.0)
    assert got["status"] == "found" and 3.0 <= got["k"] <= 3.0 + max(budget.FLOOR_RESOLUTION, 0.1 * got["k"])
    assert got["tried"][:3] == [[20.0, "ok"], [10.0, "error"], [10.0, "ok"]]  # every run, the crash too


def test_outcomes_short_of_memory_keep_bisecting_and_the_planners_refusal_counts_as_failing() -> None:
    assert [budget.outcome(_probe(1, h)) for h in ("oom", "enomem", "refused", "crash", True)] == [
        "oom", "enomem", "refused", "error", "ok"]
    assert budget.outcome({"ok": False, "error": "no plan: budget too small"}) == "refused"
    tried = [(20.0, "ok"), (10.0, "refused"), (15.0, "enomem")]
    assert budget.next_k(tried, 20.0) == 17.5
    assert budget.next_k(tried + [(17.5, "ok")], 20.0) == 16.25  # [15, 17.5] is wider than 10% of 17.5
    assert budget.next_k(tried + [(17.5, "ok"), (16.25, "oom")], 20.0) is None  # [16.25, 17.5]: 1.25 <= 1.75


def test_floor_ratio_is_memstrata_k_over_the_best_stock_k() -> None:
    floors = {"memstrata": [(20, True), (10, True), (5, True), (2.5, "refused"), (3.75, True), (3.12, True),
                            (2.81, "oom")],
              "stock-tuned": [(20, True), (10, True), (5, "oom"), (7.5, True), (6.25, "oom"), (6.88, True)],
              "stock-cpu": [(20, True), (10, "oom"), (15, "oom"), (17.5, True), (16.25, True)]}
    m = budget.summarize_model(_model([3.0] * 3, [10.0] * 3, 1.0, 1.0, floors=floors), FIO, "vda")
    assert m["floors"]["memstrata"]["floor"]["k"] == 3.12
    fr = m["floor_ratio"]
    assert fr["stock"] == "stock-tuned" and fr["stock_k"] == 6.88 and fr["ratio"] == round(3.12 / 6.88, 3)
    assert m["targets"][0]["pass"] is False  # 0.453 > 0.45
    floors["memstrata"] = [(20, True), (10, True), (5, True), (2.5, True), (1.25, "oom"), (1.88, "oom"), (2.19, True)]
    m = budget.summarize_model(_model([3.0] * 3, [10.0] * 3, 1.0, 1.0, floors=floors), FIO, "vda")
    assert m["floor_ratio"]["ratio"] == round(2.19 / 6.88, 3) and m["targets"][0]["pass"] is True


def test_floor_ratio_is_unknown_when_a_stock_bisection_crashed_and_an_upper_bound_when_none_fits() -> None:
    floors = {"memstrata": [(20, True), (10, True), (5, "oom"), (7.5, "oom"), (8.75, True), (8.12, "oom")],
              "stock-tuned": [(20, True), (10, "crash")]}
    m = budget.summarize_model(_model([3.0] * 3, [10.0] * 3, 1.0, 1.0, floors=floors), FIO, "vda")
    assert m["floor_ratio"]["ratio"] is None and "stock-tuned: error" in m["floor_ratio"]["why"]
    assert m["targets"][0]["pass"] is None
    floors["stock-tuned"] = [(20, "oom")]
    m = budget.summarize_model(_model([3.0] * 3, [10.0] * 3, 1.0, 1.0, floors=floors), FIO, "vda")
    assert m["floor_ratio"]["upper_bound"] and m["floor_ratio"]["ratio"] == round(8.75 / 20, 3)


def test_measured_caps_run_from_memstrata_floor_through_stock_floors_to_all_fits() -> None:
    f = {"memstrata": {"k": 3.1}, "stock-tuned": {"k": 6.9}, "stock-default": {"k": 7.2}, "stock-cpu": {"k": None}}
    assert budget.measure_ks(f, 20.0) == [3.1, 6.9, 20.0]  # 7.2 is within 0.5 of 6.9
    assert budget.measure_ks({"memstrata": {"k": 4.0}, "stock-cpu": {"k": None}}, 20.0) == [4.0, 12.0, 20.0]
    assert budget.measure_ks({"memstrata": {"k": None}}, 20.0) == [20.0]
    f = {"memstrata": {"k": 3.1, "upper_k": 3.1}, "stock-tuned": {"k": 6.9, "upper_k": 6.9},
         "stock-cpu": {"k": None, "upper_k": 20.0}}
    assert budget.fits_at(f, 3.1) == ["memstrata"] and budget.fits_at(f, 20.0) == list(f)


def test_param_reads_are_the_engine_counter_for_memstrata_and_all_reads_for_stock() -> None:
    assert budget.param_reads(_run("memstrata", 1.0, io=(900, 10), param_read_bytes=500), "vda") == (
        500, "param (engine counter)")
    assert budget.param_reads(_run("stock-tuned", 1.0, io=(900, 10)), "vda") == (900, "all reads (params + optimizer)")


def _verdicts(m: dict[str, Any]) -> list[bool | None]:
    """The exact engine's targets (the delayed update's: tests/offload/test_offload_bench_delayed.py)."""
    return [t["pass"] for t in budget.summarize_model(m, FIO, "vda")["targets"] if "delayed" not in t["target"]]


GOOD_FLOORS = {"memstrata": [(20, True), (10, True), (5, True), (2.5, "oom"), (3.75, True), (3.12, True),
                             (2.81, "oom")],
               "stock-tuned": [(20, True), (10, "oom"), (15, True), (12.5, True), (11.25, True), (10.62, "oom")]}


def test_targets_pass_when_every_ratio_is_met() -> None:
    # memstrata 3 s against a 2 s overlapped bound is 1.5x: give it 2.2 s to be within 1.15x
    assert _verdicts(_model([2.2] * 3, [10.0] * 3, 1.0, 1.0, floors=GOOD_FLOORS)) == [True] * 5


def test_targets_fail_on_a_high_floor_slow_steps_and_memory() -> None:
    high = {**GOOD_FLOORS, "memstrata": [(20, True), (10, True), (5, "oom"), (7.5, True), (6.25, True), (5.62, True),
                                         (5.31, "oom")]}
    assert _verdicts(_model([2.2] * 3, [10.0] * 3, 1.0, 1.0, floors=high))[0] is False  # 5.62 / 11.25 = 0.5
    slow = _verdicts(_model([2.2, 2.2, 6.5], [10.0] * 3, 1.0, 1.0, floors=GOOD_FLOORS))
    assert slow[1] is False and slow[2] is False  # 6.5 s vs stock 10 s > 0.6x; vs the 2 s bound > 1.15x
    fat = _verdicts(_model([2.2] * 3, [10.0] * 3, 1.0, 1.0, rss=2 * G, floors=GOOD_FLOORS))
    assert fat[4] is False and fat[3] is True  # 2 GiB vs stock CPU's 2 GiB > 0.75x
    cpu_faster = _verdicts(_model([2.2] * 3, [10.0] * 3, 0.9, 1.0, floors=GOOD_FLOORS))
    assert cpu_faster[3] is False  # stock CPU 0.9 s vs memstrata 1.0 s: 0.9x speed


def test_targets_are_not_measurable_without_the_runs_they_compare() -> None:
    m = _model([3.0, 3.0, 3.0], [None] * 3, None, None)
    v = _verdicts(m)
    assert v == [None] * 5  # no floors, no stock run, no all-DRAM run (so no compute floor either)
    assert m["caps"][0]["runs"][0]["bound"]["io_bound"] is None


def test_markdown_shows_floors_failures_bounds_and_targets() -> None:
    m = budget.summarize_model(_model([None, 2.2, 2.2], [10.0] * 3, 1.0, 1.0, floors=GOOD_FLOORS), FIO, "vda")
    m["caps"][0]["runs"][0].update(oom_killed=True, error="killed by the OOM killer under the cap")
    results = {"machine": {"cores": 2, "scratch": "/x", "scratch_fs": "ext4"}, "fio": FIO, "backing_device": "vda",
               "dram_cap": {"enforced": True, "mechanism": "cgroup v1"}, "seq": 128, "batch": 1, "precision": "bf16",
               "warmup": 2, "measured": 8, "base_formula": budget.BASE_FORMULA, "idle_interpreter_rss_bytes": G,
               "bound_formula": "b", "statistic": "s", "loadavg_start": [0, 0, 0], "models": {"gpt-x": m}}
    md = markdown(results)
    assert "| gpt-x | 2.2 |" in md and "OOM: killed by the OOM killer" in md
    assert "| gpt-x | memstrata | 3.12 |" in md and "2.5: oom" in md
    assert "| gpt-x | floor_ratio | 0.277 |" in md  # 3.12 / 11.25
    assert "| 2.00 | 1.10 | 3.00 | 0.73 |" in md  # 8: overlapped max(1, 2) = 2 s; serial 1 + 2 = 3 s
    assert "floor: memstrata's k" in md and "| pass |" in md


def test_probes_that_run_out_bound_the_floor_and_the_ratio_stays_conservative() -> None:
    """Six probes: memstrata ran at 3.75 and was refused at 3.125, an interval wider than the resolution. Its
    floor is 'bounded' at 3.75 (its true floor is no higher); a stock floor bounded the same way counts at its
    failing k, so the ratio is an upper bound."""
    probes = [_probe(k, h) for k, h in ((20, True), (10, True), (5, True), (2.5, "refused"), (3.75, True),
                                        (3.125, "refused"))]
    got = budget.floor_of(probes, 20.0)
    assert got["status"] == "bounded" and got["k"] == 3.75 and got["failing_k"] == 3.125
    assert "probes ran out" in got["reason"]
    floors = {"memstrata": [(k, o) for k, o in ((20, True), (10, True), (5, True), (2.5, "refused"), (3.75, True),
                                                (3.125, "refused"))],
              "stock-tuned": [(20, True), (10, "oom"), (15, True), (12.5, "oom"), (13.75, True), (13.1, "oom")],
              "stock-cpu": [(20, True), (10, "oom"), (15, "oom"), (17.5, True), (16.25, "oom"), (16.9, True)]}
    m = budget.summarize_model(_model([3.0] * 3, [10.0] * 3, 1.0, 1.0, floors=floors), FIO, "vda")
    fr = m["floor_ratio"]
    assert fr["stock"] == "stock-tuned" and fr["stock_k"] == 13.75 and fr["ratio"] == round(3.75 / 13.75, 3)
    floors["stock-tuned"] = floors["stock-tuned"][:4]  # [12.5 oom, 15 ok]: bounded
    m = budget.summarize_model(_model([3.0] * 3, [10.0] * 3, 1.0, 1.0, floors=floors), FIO, "vda")
    fr = m["floor_ratio"]
    assert m["floors"]["stock-tuned"]["floor"]["status"] == "bounded"
    assert fr["stock_k"] == 12.5 and fr["upper_bound"] and fr["ratio"] == round(3.75 / 12.5, 3)


def test_the_overlap_benchmark_compares_beside_with_in_place_and_bounds_each_step() -> None:
    import overlap

    fio = {"read_bytes_per_s": 1e9, "write_bytes_per_s": 5e8}
    io = {"read_bytes": 10**9, "write_bytes": 5 * 10**8}  # 1 s + 1 s of I/O per step

    def run(name: str, step: float, losses: list[float], on: bool) -> dict[str, Any]:
        return {**_run(name, step, rss=2 * G if on else G), "losses": losses, "io": {"sda": io},
                "plan": {"offload_devices": ["cpu", "nvme"]},
                "swap": {"updateOverlap": {"on": on, "refused": "" if on else "overlap_update is off",
                                           "forwardWaitSeconds": 0.25}}}

    cap = {"k": 8, "bytes": 3 * G, "all_fits": False,
           "runs": [run("memstrata-in-place", 4.0, [2.0, 1.5], False), run("memstrata-beside", 3.0, [2.0, 1.5], True)]}
    fits = {"k": 20.0, "bytes": 5 * G, "all_fits": True,
            "runs": [run("memstrata-beside", 1.25, [2.0], True), run("memstrata-in-place", 1.5, [2.0], False)]}
    results = {"models": {"gpt-125m": {"caps": [cap, fits]}}, "fio": fio, "backing_device": "sda", "seq": 128,
               "batch": 1, "statistic": "median", "machine": {"cores": 2}}
    overlap.summarize(results)
    assert results["models"]["gpt-125m"]["compute_floor_seconds"] == 1.25  # the faster all-fits step
    assert cap["step_ratio"] == 0.75 and cap["same_losses"] is True and cap["memory_ratio"] == 2.0
    beside = cap["runs"][1]
    assert beside["bound"]["io_seconds"] == 2.0 and beside["bound"]["overlapped_seconds"] == 2.0
    assert beside["bound"]["ratio"] == 1.5 and beside["overlap"]["on"]
    cap["runs"][0]["losses"] = [2.0, 1.25]  # a changed loss is reported, never hidden by a faster step
    overlap.summarize(results)
    assert cap["same_losses"] is False
    table = overlap.markdown(results)
    assert "| gpt-125m | 8 | 3.00 | cpu | 3.000 | 4.000 | 0.75 | False | 2.0 | 1.5 | 0.25 | 2.0 |" in table


def test_param_reads_flags_a_contender_that_trained_another_model() -> None:
    import param_reads

    def run(contender: str, losses: list[float], read: int) -> dict[str, Any]:
        return {"contender": contender, "ok": True, "losses": losses, "read_bytes_per_step": read,
                "weight_reads_per_step": read / 100, "param_counter_bytes_per_step": None,
                "step": {"median": read / 1000}}

    results = {"name": "x", "seq": 8, "batch": 1, "accumulation": 4, "warmup": 1, "measured": 3,
               "machine": {"cores": 2}, "models": {"m": {"runs": [
                   run(param_reads.LAYER_MAJOR, [10.96, 10.404, 9.077], 200),
                   run(param_reads.MICRO, [10.96, 10.4042, 9.0770], 800),
                   run(param_reads.STOCK, [10.96, 10.497, 10.585], 900)]}}}
    m = param_reads.summarize(results)["models"]["m"]
    assert m["reads_memstrata-micro-batches_over_layer_major"] == 4.0 and m["reads_stock_over_layer_major"] == 4.5
    assert [r["losses_differ_from_step"] for r in m["runs"]] == [None, None, 2]
    table = param_reads.markdown(results)
    assert "| m | stock | 0.0 MiB | 9.0 |" in table and "differ from step 2 |" in table
