"""The reconciler's work queue: one reconcile per job at a time, bursts coalesced, timers kept earliest,
errors retried with growing delays. The API calls are not involved: `reconcile` is replaced by a
recorder, so what is tested is the queue itself."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("aiohttp", reason="the operator's dependencies are not installed; run `make install`")

from memstrata.operator.kube import Kube  # noqa: E402
from memstrata.operator.reconciler import Reconciler  # noqa: E402


class Recording(Reconciler):
    def __init__(self, fail: int = 0, hold: float = 0.0) -> None:
        super().__init__(Kube("http://127.0.0.1:9", False), workers=4)
        self.calls: list[tuple[str, str]] = []
        self.active: set[tuple[str, str]] = set()
        self.overlap = False
        self.fail, self.hold = fail, hold

    async def reconcile(self, key):  # type: ignore[override]
        if key in self.active:
            self.overlap = True
        self.active.add(key)
        self.calls.append(key)
        await asyncio.sleep(self.hold)
        self.active.discard(key)
        if self.fail:
            self.fail -= 1
            raise RuntimeError("API server said no")


def run(coro):
    return asyncio.run(coro)


def test_a_burst_of_triggers_for_one_job_is_one_reconcile_plus_one_rerun():
    async def go():
        r = Recording(hold=0.05)
        await r.start()
        r.enqueue(("ns", "a"))
        await asyncio.sleep(0.01)  # now running
        for _ in range(10):
            r.enqueue(("ns", "a"))  # changes while it runs: one more run afterwards, not ten
        r.enqueue(("ns", "b"))
        await asyncio.sleep(0.3)
        await r.stop()
        return r

    r = run(go())
    assert r.calls.count(("ns", "a")) == 2 and r.calls.count(("ns", "b")) == 1
    assert not r.overlap


def test_the_earliest_timer_wins():
    async def go():
        r = Recording()
        await r.start()
        r.enqueue(("ns", "a"), delay=5.0)
        r.enqueue(("ns", "a"), delay=0.05)
        r.enqueue(("ns", "a"), delay=3.0)  # later than the pending one: ignored
        await asyncio.sleep(0.3)
        await r.stop()
        return r

    assert run(go()).calls == [("ns", "a")]


def test_errors_are_retried_with_growing_delay():
    async def go():
        r = Recording(fail=2)
        await r.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        r.enqueue(("ns", "a"))
        while len(r.calls) < 3 and loop.time() - t0 < 5:
            await asyncio.sleep(0.02)
        elapsed = loop.time() - t0
        await r.stop()
        return r, elapsed

    r, elapsed = run(go())
    assert len(r.calls) == 3 and 1.4 <= elapsed < 3  # 0.5 s then 1 s
