"""How `make test` runs its parts side by side, and what each part cost.

`make test` runs pytest with xdist workers (`-n`, `--dist loadgroup`): a test waiting on an API server, a kubelet or
a guest leaves the CPU to another. What cannot be had twice stays on one worker: the real node (one kubelet and
containerd per host) and the QEMU guest's shared boot (a second would double it). The control-plane tests share one
worker too, with one control plane and operator, as in a serial run (a plane and an operator per worker measured the
same suite time, 1235 s against 1240 s, with three times the processes to leave behind on a failure). Everything
else goes wherever a worker is free. At the end, one line per stage: its tests, the wall time from its first test's
start to its last's end, the seconds its tests took (which add up over the workers) and the CPU they spent.
"""
from __future__ import annotations

import resource
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from _pytest.nodeid import coerce_node_id

# (stage, the node-id prefixes of its tests), in the order they are printed: the first that matches wins.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("realnode", ("e2e/realnode/",)),
    ("guest", ("e2e/node/",)),
    ("cluster", ("e2e/",)),
    ("offload", ("tests/offload/", "tests/native/")),
    ("runtime", ("tests/runtime/", "tests/cli/")),
    ("unit", ("tests/",)),
)
# Fixtures whose peer exists once per worker that asks for it: their tests share one worker (xdist_group).
SHARED_PEERS: tuple[tuple[str, str], ...] = (
    ("real_cluster", "realnode"),
    ("probe_boot", "guest"),
    ("cluster", "cluster"),
    ("quiet_cluster", "cluster"),
)


# The two longest groups first (the control-plane tests, then the real node), so that neither starts last.
START_ORDER = ["cluster", "realnode", "offload", "guest", "runtime", "unit", "other"]


def stage_of(nodeid: str) -> str:
    for name, prefixes in STAGES:
        if nodeid.startswith(prefixes):
            return name
    return "other"


def group_of(fixtures: list[str]) -> str | None:
    """The worker group of a test that uses these fixtures (transitively): the first shared peer it needs."""
    for fixture, group in SHARED_PEERS:
        if fixture in fixtures:
            return group
    return None


def module_group(item: pytest.Item) -> str | None:
    """A test whose fixtures include one scoped to its module (or class) stays with its module's other tests: on
    another worker that fixture (often a whole training run) would be made again."""
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        if defs and defs[-1].scope in ("module", "class", "package"):
            return item.nodeid.split("::")[0]
    return None


def pytest_itemcollected(item: pytest.Item) -> None:
    group = group_of(list(getattr(item, "fixturenames", ()))) or module_group(item)
    if group is None:
        return
    item.add_marker(pytest.mark.xdist_group(group))
    if getattr(item.config.option, "loadgroup", False):  # set on xdist's workers under --dist loadgroup
        # xdist's scheduler groups by an "@group" suffix of the node id, which its worker writes to `_nodeid`;
        # pytest 9.2 derives the node id from `_id`, so the suffix is written here (or no test would be grouped).
        item._id = coerce_node_id(f"{item.nodeid}@{group}")  # type: ignore[attr-defined]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: START_ORDER.index(stage_of(item.nodeid)))


@dataclass
class Stage:
    tests: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    first: float = field(default=float("inf"))
    last: float = 0.0


_stages: dict[str, Stage] = {}
_modules: dict[str, Stage] = {}  # the same sums per test module, for the costliest-modules lines
COSTLIEST = 15
SESSION_TEARDOWN = "(each worker's last teardown: its session fixtures, and its last module's)"
_began = time.time()


def _cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for (a test's training runs, its CLIs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_cpu_mark = [0.0]  # set as each test starts (pytest_runtest_logstart)


def pytest_runtest_logstart() -> None:
    _cpu_mark[0] = _cpu_seconds()  # not the collection's, nor what ran between tests


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    # The CPU spent since the previous phase's report, carried to the controller with the report (xdist sends
    # a report's attributes along). On 2 cores the CPU, not the wall, is what the suite's time is made of.
    now = _cpu_seconds()
    report = outcome.get_result()
    report.cpu_seconds = now - _cpu_mark[0]
    _cpu_mark[0] = now
    if call.when == "teardown" and _last_on_worker[0]:
        report.session_teardown = True  # a worker's last teardown also stops its session fixtures (planes, nodes)


_last_on_worker = [False]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _last_on_worker[0] = nextitem is None
    out = yield  # the test's own fixtures first: they may still use the peers
    # Once every test of a shared peer's group has run here, its peers are stopped (e2e.lifetime) instead of idling
    # through the rest of the suite. Counted, not inferred from `nextitem`: in a serial run a group's tests need
    # not be in a row; where its tests were spread over workers (not --dist loadgroup) the count is never reached.
    group = _worker_group(item)
    if group is not None:
        if not _group_sizes:
            _group_sizes.update(_worker_group(i) for i in item.session.items)
        _group_runs[group] += 1
        if _group_runs[group] == _group_sizes[group]:
            from e2e.lifetime import group_ended

            group_ended(group)
    return out


_group_sizes: Counter[str | None] = Counter()
_group_runs: Counter[str] = Counter()


def _worker_group(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return str(marker.args[0]) if marker and marker.args else None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Called in the controller for every worker's report, so the sums cover the whole run.
    # The CPU of a worker's session fixtures (control planes, the real node: their daemons are reaped as they
    # stop) is no one test module's cost.
    module = SESSION_TEARDOWN if getattr(report, "session_teardown", False) else report.nodeid.split("::")[0]
    for stage in (_stages.setdefault(stage_of(report.nodeid), Stage()), _modules.setdefault(module, Stage())):
        stage.seconds += report.duration
        stage.cpu += getattr(report, "cpu_seconds", 0.0)
        stage.first, stage.last = min(stage.first, report.start), max(stage.last, report.stop)
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            stage.tests += 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _stages:
        return
    terminalreporter.section("time per stage")
    for name in [s for s, _ in STAGES] + ["other"]:
        if name in _stages:
            s = _stages[name]
            terminalreporter.write_line(
                f"[stage] {name:<9} {s.tests:5d} tests  {s.last - s.first:7.1f} s wall "
                f"(from {s.first - _began:6.1f} s to {s.last - _began:6.1f} s)  {s.seconds:7.1f} s in its tests, "
                f"{s.cpu:7.1f} s of CPU")
    # Where to look first when the suite grows slow: on 2 cores the CPU a module spends is what it costs the rest.
    for module, s in sorted(_modules.items(), key=lambda kv: -kv[1].cpu)[:COSTLIEST]:
        terminalreporter.write_line(f"[cost] {s.cpu:7.1f} s of CPU  {s.seconds:7.1f} s  {s.tests:4d} tests  {module}")
