"""A shared peer stops when its group ends on the worker (e2e.lifetime): each stop runs once, whether the group's
end or the fixture's own finally comes first, the last started first, and every peer stops even if one fails."""
from __future__ import annotations

import pytest

from e2e.lifetime import group_ended, until_group_ends


def test_each_peer_stops_once_the_last_started_first() -> None:
    stopped: list[str] = []
    plane = until_group_ends("g-order", lambda: stopped.append("plane"))
    operator = until_group_ends("g-order", lambda: stopped.append("operator"))
    group_ended("g-order")
    plane(), operator()  # the fixtures' finally, at the session's end
    group_ended("g-order")  # nothing left to stop
    assert stopped == ["operator", "plane"]


def test_a_failing_stop_does_not_keep_the_others_running() -> None:
    stopped: list[str] = []

    def broken() -> None:
        raise RuntimeError("kubelet would not stop")

    until_group_ends("g-fail", lambda: stopped.append("plane"))
    until_group_ends("g-fail", broken)
    with pytest.raises(RuntimeError, match="kubelet"):
        group_ended("g-fail")
    assert stopped == ["plane"]


def test_a_fixture_that_stopped_first_is_not_stopped_again() -> None:
    stopped: list[str] = []
    stop = until_group_ends("g-early", lambda: stopped.append("plane"))
    stop()  # the fixture's setup failed after starting its peer: its finally stops it
    group_ended("g-early")
    assert stopped == ["plane"]
