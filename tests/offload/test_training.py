"""memstrata's swap layer inside real DeepSpeed ZeRO-3 training, side by side with stock ZeRO-Infinity.

Same model, seed, data and precision through benchmarks/offload/harness.py:
the loss of every step must agree; memstrata's NVMe stratum (a real loop
device) must carry the optimizer state while DeepSpeed's swap folder stays
empty; and a run killed with SIGKILL mid-step must leave no extent behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from offload_helpers import REPO, files_under, harness_cmd, run_harness

pytestmark = [pytest.mark.loopdev, pytest.mark.usefixtures("deepspeed_ready")]

REL_TOL = 2e-2


def assert_losses_agree(stock: dict[str, Any], ours: dict[str, Any], steps: int) -> None:
    assert len(stock["losses"]) == len(ours["losses"]) == steps
    for i, (a, b) in enumerate(zip(stock["losses"], ours["losses"]), start=1):
        assert abs(a - b) <= REL_TOL * abs(a), f"step {i}: stock loss {a}, memstrata loss {b}"
    assert ours["losses"][-1] < ours["losses"][0], "the loss did not fall: nothing was learned"


def assert_no_files_in_deepspeed_swap_folder(result: dict[str, Any]) -> None:
    leftovers = files_under(Path(result["swap_dir"]) / "zero_stage_3")
    assert leftovers == [], f"memstrata run wrote DeepSpeed swap files (silent fallback): {leftovers[:5]}"


def test_gpt_tiny_matches_stock_with_state_on_the_nvme_stratum(loopdev, tmp_path: Path) -> None:
    steps = 20
    stock = run_harness("stock", tmp_path, steps=steps)
    dev = loopdev(512 << 20)
    ours = run_harness("memstrata", tmp_path, steps=steps, nvme=[dev], swap={"checksums": True})
    assert_losses_agree(stock, ours, steps)

    # Stock really went through its files; memstrata wrote none.
    assert files_under(Path(stock["swap_dir"]) / "zero_stage_3"), "stock run wrote no swap files"
    assert_no_files_in_deepspeed_swap_folder(ours)

    nvme = ours["swap"]["nvme"]
    assert nvme["namespaces"] == [dev]
    opt = nvme["byKind"]["optimizer"]
    # fp32 master + two Adam moments of every parameter, written at least once per step.
    state_bytes = 3 * 4 * ours["params"]
    assert opt["written"] >= state_bytes * steps * 0.5, (opt, state_bytes)
    assert opt["read"] >= state_bytes * (steps - 1) * 0.5, (opt, state_bytes)
    assert nvme["bytesWritten"] >= opt["written"]  # the device counters saw it too
    # Every read was checked against the hash of what was written.
    assert ours["checksums_verified"] > 0


def test_fp16_uses_the_one_pass_overflow_check(loopdev, tmp_path: Path) -> None:
    import torch

    try:
        fp16_ok = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        fp16_ok = False
    if not fp16_ok:
        pytest.skip("this CPU has no fp16 support in oneDNN, so DeepSpeed's CPU accelerator refuses fp16 "
                    "('Type fp16 is not supported on your device'); the fp16 overflow hook runs only on such hosts")
    steps = 6
    extra = ["--precision", "fp16"]
    stock = run_harness("stock", tmp_path, steps=steps, extra=extra)
    ours = run_harness("memstrata", tmp_path, steps=steps, nvme=[loopdev(512 << 20)], extra=extra)
    assert ours["overflow_checks"] >= steps
    assert_losses_agree(stock, ours, steps)
    assert_no_files_in_deepspeed_swap_folder(ours)


def test_two_namespaces_and_the_dram_cache(loopdev, tmp_path: Path) -> None:
    devs = [loopdev(384 << 20), loopdev(384 << 20)]
    ours = run_harness("memstrata", tmp_path, steps=4, nvme=devs,
                       swap={"cache_subgroups": 1, "stripe_bytes": 256 << 10})
    nvme, dram = ours["swap"]["nvme"], ours["swap"]["dram"]
    assert nvme["namespaces"] == devs
    assert dram["optimizerCacheHits"] >= 1 and dram["optimizerCacheBytes"] > 0
    assert_no_files_in_deepspeed_swap_folder(ours)


def test_kill_mid_step_leaks_no_extents(loopdev, tmp_path: Path) -> None:
    from memstrata.runtime.strata.nvme import NvmeEngine

    dev = loopdev(512 << 20)
    out = tmp_path / "killed.json"
    cmd = harness_cmd("memstrata", out, tmp_path / "swap", steps=5, nvme=[dev], extra=["--pause-at-step", "3"])
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{REPO / 'runtime'}:{REPO / 'operator'}:"
           + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not out.exists():
            assert proc.poll() is None, f"harness exited early: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "harness never reached step 3"
            time.sleep(0.5)
        paused = json.loads(out.read_text())
        assert paused["swap"]["nvme"]["extentsLive"] > 0  # state really lives on the device when we kill
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with NvmeEngine.open([dev], job="after-kill") as engine:
        assert [path for path, _ in engine.recovered] == [dev]  # it saw the dead run's header
        space = engine.stats()[0].space
        assert space.free_bytes == space.capacity_bytes and space.allocated_extents == 0


@pytest.mark.slow
def test_gpt_125m_matches_stock(loopdev, tmp_path: Path) -> None:
    # 4 steps: three updates, each after the first reading back the state the previous one wrote (the losses of
    # steps 2-4 depend on it); gpt-tiny runs 20. Each step here costs about 4 s of CPU per engine.
    steps = 4
    extra = ["--seq", "64", "--batch", "2"]
    stock = run_harness("stock", tmp_path, steps=steps, preset="gpt-125m", extra=extra, timeout=1500)
    ours = run_harness("memstrata", tmp_path, steps=steps, preset="gpt-125m", extra=extra,
                       nvme=[loopdev(4 << 30)], timeout=1500)
    assert_losses_agree(stock, ours, steps)
    assert_no_files_in_deepspeed_swap_folder(ours)
    assert ours["swap"]["nvme"]["byKind"]["optimizer"]["written"] >= 3 * 4 * ours["params"] * steps * 0.5


def test_subgroup_order_reverses_and_keeps_the_last_k(loopdev, tmp_path: Path) -> None:
    """MLP-Offload's policy: step i walks the sub-groups in the reverse order of step i-1, and the K walked
    last stay in DRAM, so every step after the first starts with K hits; evicted ones read back intact."""
    k = 1
    ours = run_harness("memstrata", tmp_path, steps=3, nvme=[loopdev(384 << 20)],
                       swap={"cache_subgroups": k, "checksums": True})
    orders = ours["swap"]["dram"]["subGroupOrders"]
    assert len(orders) == 3, orders
    groups = len(orders[0])
    assert groups > k, f"gpt-tiny must have more sub-groups than the cache holds to show eviction: {orders}"
    assert orders[0] == sorted(orders[0])
    assert orders[1] == orders[0][::-1] and orders[2] == orders[1][::-1], orders
    hits = ours["cache_hits"]
    per_step = [hits[0]] + [b - a for a, b in zip(hits, hits[1:])]
    assert per_step == [0, k, k], f"cache hits per step {per_step} (cumulative {hits}), orders {orders}"
    assert ours["checksums_verified"] > 0, "evicted state must be read back and checked against what was written"
    assert ours["losses"][-1] < ours["losses"][0]
    assert_no_files_in_deepspeed_swap_folder(ours)


def test_gradients_stay_in_dram_in_16_bit(loopdev, tmp_path: Path) -> None:
    """Stock also writes an fp32 copy of every gradient to NVMe and reads it back in the update; memstrata keeps
    only the 16-bit flat buffer in DRAM and widens from it: the same losses, 4 bytes per parameter per step less
    I/O each way."""
    steps = 5
    dev = loopdev(512 << 20)
    on = run_harness("memstrata", tmp_path / "on", steps=steps, nvme=[dev])
    off = run_harness("memstrata", tmp_path / "off", steps=steps, nvme=[dev], swap={"dram_gradients": False})
    assert on["losses"] == pytest.approx(off["losses"], rel=1e-6)
    grads = on["swap"]["dram"]["gradients"]
    assert grads["dtype"] == "bfloat16"
    assert grads["bytes"] == pytest.approx(2 * on["params"], rel=0.01)  # the flat buffer is bf16, never widened
    assert grads["widenedBytes"] >= 4 * on["params"] * (steps - 1)  # every update widened the real gradients
    assert off["swap"]["dram"]["gradients"] is None
    saved = {d: off["swap"]["nvme"]["byKind"]["optimizer"][d] - on["swap"]["nvme"]["byKind"]["optimizer"][d]
             for d in ("written", "read")}
    fp32_grads = 4 * on["params"] * steps
    assert saved["written"] >= 0.9 * fp32_grads and saved["read"] >= 0.9 * 4 * on["params"] * (steps - 1), saved


def test_a_gradient_set_through_deepspeed_is_the_one_read_back(loopdev, tmp_path: Path) -> None:
    """`safe_set_full_grad` on an NVMe sub-group writes the gradient back; memstrata keeps gradients in DRAM, so
    the edit must land there (not on NVMe, where nothing of the gradient is), or the update would use the old one."""
    out = tmp_path / "edit.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{REPO / 'runtime'}:{REPO / 'operator'}:"
           + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "grad_edit_worker.py"),
                           loopdev(512 << 20), str(tmp_path / "swap"), str(out)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["params"] > 0 and r["before_nonzero"], r
    assert r["after_all_half"], r
