"""A keyed work queue, like a controller's: the reconciler's (memstrata.operator.reconciler) beneath what it does.

Every trigger only enqueues a key; a few workers take keys off the queue, and one key is never reconciled by two
workers at once — a key that changes while it is being reconciled is simply run again afterwards. A delayed
enqueue keeps the earliest wake-up per key. A reconcile that fails runs again after a growing delay; one that
meets a conflict (someone wrote the object since it was read) runs again at once. Workers take keys only while
this replica leads (the `gate`, a Lease: memstrata.operator.leadership).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from memstrata.operator.kube import Conflict, KubeError, NotLeading
from memstrata.operator.metrics import OperatorMetrics

log = logging.getLogger("memstrata.operator")
JobKey = tuple[str, str]


class Gate(Protocol):
    def leading(self) -> bool: ...

    async def wait_leading(self) -> None: ...


class WorkQueue:
    """The queue, its workers and its timers; a subclass says what reconciling a key is (`reconcile`), what to
    drop when its copy of the key's object may be stale, and what to tell when a reconcile fails."""

    def __init__(self, gate: Gate, workers: int, metrics: OperatorMetrics | None = None) -> None:
        self.gate = gate
        self.metrics = metrics or OperatorMetrics()
        self.metrics.live.queue_depth = lambda: len(self._queued)
        self.metrics.live.reconciling = lambda: len(self._running)
        self.metrics.live.leading = gate.leading
        self._workers_n = workers
        self._workers: list[asyncio.Task[None]] = []
        self._queue: asyncio.Queue[JobKey] = asyncio.Queue()
        self._queued: set[JobKey] = set()
        self._running: set[JobKey] = set()
        self._dirty: set[JobKey] = set()
        self._timers: dict[JobKey, tuple[float, asyncio.TimerHandle]] = {}
        self._errors: dict[JobKey, int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def reconcile(self, key: JobKey) -> None:
        raise NotImplementedError

    def drop_cached(self, key: JobKey) -> None:
        """What is known of `key` may be older than the API server's: the next reconcile reads it afresh."""

    def on_error(self, key: JobKey, tries: int, delay: float, exc: Exception) -> None:
        """A reconcile of `key` failed, the `tries`-th time in a row; it runs again in `delay` seconds."""

    def forget(self, key: JobKey) -> None:
        self._errors.pop(key, None)
        timer = self._timers.pop(key, None)
        if timer:
            timer[1].cancel()

    def enqueue(self, key: JobKey, delay: float = 0.0) -> None:
        if delay > 0:
            loop = asyncio.get_running_loop()
            due = loop.time() + delay
            old = self._timers.get(key)
            if old and old[0] <= due:
                return  # an earlier wake-up is already set
            if old:
                old[1].cancel()
            self._timers[key] = (due, loop.call_at(due, self._fire, key))
            return
        if key in self._running:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def _fire(self, key: JobKey) -> None:
        self._timers.pop(key, None)
        self.enqueue(key)

    # -- workers ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._workers = [asyncio.create_task(self._work(), name=f"reconcile-{i}") for i in range(self._workers_n)]

    async def stop(self) -> None:
        for t in self._workers:
            t.cancel()
        await asyncio.gather(*self._workers, *self._tasks, return_exceptions=True)
        for _, handle in self._timers.values():
            handle.cancel()

    @property
    def idle(self) -> bool:
        return not self._queued and not self._running

    async def _work(self) -> None:
        while True:
            await self.gate.wait_leading()
            key = await self._queue.get()
            if not self.gate.leading():  # lost while this worker waited for work: leave the key queued
                self._queue.put_nowait(key)
                continue
            self._queued.discard(key)
            self._running.add(key)
            started = time.perf_counter()
            result = "success"
            try:
                await self.reconcile(key)
                self._errors.pop(key, None)
            except asyncio.CancelledError:
                result = "cancelled"  # stopped mid-reconcile (the operator stopping): not counted as done
                raise
            except NotLeading:
                # Keep the key: whoever leads next (this replica included) reconciles it afresh.
                result = "not_leading"
                self.drop_cached(key)
                self._dirty.add(key)
            except Conflict as exc:
                # Someone wrote the job since we read it: what we decided may be stale. Forget our copy
                # and decide again on a fresh read, at once; a conflict is not an error to back off from.
                result = "conflict"
                log.info("reconcile %s/%s: conflict (%s); again on a fresh read", *key, exc)
                self.drop_cached(key)
                self.enqueue(key)
            except Exception as exc:  # noqa: BLE001 — one job's error must not stop the others
                result = "error"
                self.metrics.reconcile_errors.labels(_reason(exc)).inc()
                n = self._errors[key] = self._errors.get(key, 0) + 1
                delay = min(0.5 * 2 ** (n - 1), 60.0)
                log.warning("reconcile %s/%s failed (try %d), again in %.1fs: %s", *key, n, delay, exc)
                self.enqueue(key, delay)
                self.on_error(key, n, delay, exc)
            finally:
                self.metrics.reconciles.labels(result).inc()
                self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
                self._running.discard(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.enqueue(key)

    def _spawn(self, coro: Any) -> None:
        """Run `coro` on the side (an event to post): `stop` waits for it."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _reason(exc: BaseException) -> str:
    """A failed reconcile's reason as a label: the API server's (Forbidden, Invalid, ...) where an API request
    failed, even under the error that reports it (a pod not created), else the error's type."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, KubeError):
            return cause.reason or f"HTTP{cause.status}"
        cause = cause.__cause__
    return type(exc).__name__
