"""Two real ranks (gloo) share one node's NVMe stratum: concurrent I/O never exceeds the token limit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from offload_helpers import REPO

from memstrata.runtime.swap.tokens import IoTokens

pytest.importorskip("torch", reason="the 2-rank test uses torch.distributed (gloo); run with the venv")

WORKER = Path(__file__).with_name("token_worker.py")


def _max_concurrency(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(t0, 1) for t0, _ in intervals] + [(t1, -1) for _, t1 in intervals])
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def _run_ranks(loopdev, tmp_path: Path, limit: int) -> list[dict]:
    stratum = f"test-{uuid.uuid4().hex[:8]}"
    port = 20000 + int(uuid.uuid4().int % 20000)
    devs = [loopdev(64 << 20), loopdev(64 << 20)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), str(REPO / "operator"),
                                                         os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(port), devs[r], stratum, str(limit),
                               str(tmp_path / f"rank{r}.json")], env=env, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    for f in Path("/dev/shm").glob(f"memstrata-io-{stratum}-*"):
        f.unlink()
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.loopdev
def test_one_token_serializes_the_ranks(loopdev, tmp_path: Path) -> None:
    ranks = _run_ranks(loopdev, tmp_path, limit=1)
    intervals = [iv for r in ranks for iv in r["intervals"]]
    assert len(intervals) == 2 * 24
    assert _max_concurrency(intervals) == 1
    assert sum(r["wait_s"] for r in ranks) > 0  # they really contended for it


@pytest.mark.loopdev
def test_two_tokens_let_both_ranks_in(loopdev, tmp_path: Path) -> None:
    # The same measurement can see overlap: with a limit of 2 the ranks do run I/O at once.
    ranks = _run_ranks(loopdev, tmp_path, limit=2)
    assert _max_concurrency([iv for r in ranks for iv in r["intervals"]]) == 2


def test_a_killed_holder_never_strands_its_token(tmp_path: Path) -> None:
    code = ("import sys, os; from memstrata.runtime.swap.tokens import IoTokens; t = IoTokens('kill', 1, root=sys.argv[1]);"
            " t.acquire(); os.kill(os.getpid(), 9)")
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'runtime'}:{REPO / 'operator'}"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, timeout=60)
    assert proc.returncode == -9
    tokens = IoTokens("kill", 1, root=tmp_path)
    tokens.acquire()  # would spin forever if the dead rank still held it
    assert tokens.held
    tokens.close()


def test_bad_limits_and_names_are_refused() -> None:
    with pytest.raises(ValueError, match="limit for stratum 'nvme' must be at least 1, got 0"):
        IoTokens("nvme", 0)
    with pytest.raises(ValueError, match="stratum name '../x'"):
        IoTokens("../x", 1)


def test_a_bounded_wait_gives_up_instead_of_hanging_on_a_peer_that_holds_the_token() -> None:
    # A peer rank holding the token while it waits in a collective for this rank must cost a bounded wait,
    # not a deadlock: the waiter goes on without a token, holds nothing, and says so in its counters.
    stratum = f"test-{uuid.uuid4().hex[:8]}"
    peer, me = IoTokens(stratum, 1, rank=0), IoTokens(stratum, 1, rank=1)
    try:
        assert peer.acquire() is True
        assert me.acquire(timeout_s=0.2) is False
        assert (me.held, me.bypasses) == (False, 1) and me.wait_seconds >= 0.2
        me.release()  # a release after a bypass must not give back the peer's token
        assert peer.held
        peer.release()
        assert me.acquire(timeout_s=0.2) is True and me.bypasses == 1
        me.release()
    finally:
        peer.close(), me.close()
        for f in Path("/dev/shm").glob(f"memstrata-io-{stratum}-*"):
            f.unlink()
