"""Session peers that stop when their group's last test on the worker has run, not at the session's end.

The tests of a shared peer (conftest.SHARED_PEERS: the control plane, the operator, Kueue, the real node) run as one
xdist group, in a row on one worker. After them that worker goes on with other stages' tests for many minutes,
and an idle control plane, kubelet and containerd would keep spending the CPU those tests need. A peer's fixture
registers its stop here; the root conftest calls `group_ended` after the group's last teardown; the fixture's own
finally calls the same stop, which runs once."""
from __future__ import annotations

from collections.abc import Callable

__all__ = ["group_ended", "until_group_ends"]

_stops: dict[str, list[Callable[[], None]]] = {}


def until_group_ends(group: str, stop: Callable[[], None]) -> Callable[[], None]:
    """`stop`, made to run at most once, and registered to run when `group` ends on this worker."""
    done = [False]

    def once() -> None:
        if not done[0]:
            done[0] = True
            stop()

    _stops.setdefault(group, []).append(once)
    return once


def group_ended(group: str) -> None:
    """Stop `group`'s peers, the last started first (the operator before the control plane it talks to)."""
    stops = _stops.pop(group, [])
    errors: list[BaseException] = []
    for stop in reversed(stops):
        try:
            stop()
        except Exception as exc:  # noqa: BLE001 - every peer stops; the first error is raised after
            errors.append(exc)
    if errors:
        raise errors[0]
