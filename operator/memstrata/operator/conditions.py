"""Building a FineTuneJob status change: fields, Kubeflow-style conditions, and the events they imply.

Pure. The builder starts from the observed status, records what the lifecycle
wants, and hands back (a) the minimal merge patch — empty when nothing changed,
so a reconcile that changes nothing writes nothing — and (b) one Kubernetes event
per condition that changed status or reason: an event on every transition.
"""
from __future__ import annotations

import copy
from datetime import datetime
from typing import Any, Mapping

from memstrata.operator.actions import Event
from memstrata.operator.observe import format_time

# Transitions a user should notice in `kubectl get events` as warnings.
WARNING_REASONS = frozenset({"Unschedulable", "BackoffAfterFailure", "BackoffLimitExceeded", "DeadlineExceeded",
                             "InsufficientMemory", "InsufficientNodes", "InvalidSpec", "PodFailed",
                             "ModelInspectionFailed", "PodRejected", "NameClash", "NotAllowed",
                             "Preempted", "PriorityClassNotFound"})


def with_condition(conds: list[dict[str, Any]], type_: str, status: str, reason: str, message: str,
                   now: str) -> list[dict[str, Any]]:
    """`conds` (a Kubernetes conditions list: a job's, a Kueue Workload's) with this condition set in place, or
    added; its lastTransitionTime moves only when its status does. Unchanged, the same list."""
    old = next((c for c in conds if c.get("type") == type_), None)
    if old and (old.get("status"), old.get("reason"), old.get("message", "")) == (status, reason, message):
        return conds
    since = old.get("lastTransitionTime", now) if old is not None and old.get("status") == status else now
    new = {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    return [new if c is old else c for c in conds] if old else conds + [new]


class StatusBuilder:
    def __init__(self, status: Mapping[str, Any], now: datetime, malformed: Mapping[str, str] | None = None) -> None:
        """`status` as read (JobView.status); `malformed`: the operator's own fields taken out of it as unreadable,
        each with why (memstrata.operator.bookkeeping). The patch removes (or rewrites) them, with a warning each."""
        self._new = copy.deepcopy(dict(status))
        self._malformed = dict(malformed or {})
        # The stored value stands as "something other than what is written now", so the patch carries the key.
        self._old = {**copy.deepcopy(dict(status)), **self._malformed}
        self.now_str = format_time(now)

    def get(self, key: str) -> Any:
        return self._new.get(key)

    def set(self, key: str, value: Any) -> None:
        if value is None:
            self._new.pop(key, None)
        else:
            self._new[key] = value

    def phase(self, phase: str, message: str) -> None:
        self.set("phase", phase)
        self.set("message", message)

    def _conditions(self) -> list[dict[str, Any]]:
        return list(self._new.get("conditions") or [])

    def condition(self, type_: str, status: str, reason: str, message: str) -> None:
        """Set a condition; lastTransitionTime moves only when its status does."""
        self._new["conditions"] = with_condition(self._conditions(), type_, status, reason, message, self.now_str)

    def condition_if_true(self, type_: str, status: str, reason: str, message: str) -> None:
        """Close a condition that is currently True; leave absent ones absent."""
        old = next((c for c in self._conditions() if c.get("type") == type_), None)
        if old is not None and old.get("status") == "True":
            self.condition(type_, status, reason, message)

    def patch(self) -> dict[str, Any]:
        patch: dict[str, Any] = {}
        for key in set(self._old) | set(self._new):
            if self._old.get(key) != self._new.get(key):
                patch[key] = self._new.get(key)
        return patch

    def events(self) -> list[Event]:
        before = {c.get("type"): c for c in self._old.get("conditions") or []}
        out = [Event("Warning", "MalformedStatus", f"{why}: a field only the operator writes; it was not acted on, "
                                                   "and is removed") for why in self._malformed.values()]
        for cond in self._new.get("conditions") or []:
            old = before.get(cond["type"])
            if old is not None and (old.get("status"), old.get("reason")) == (cond["status"], cond["reason"]):
                continue
            kind = "Warning" if cond["reason"] in WARNING_REASONS and cond["status"] != "False" \
                or cond["reason"] == "Unschedulable" else "Normal"
            text = cond.get("message") or f"{cond['type']} is {cond['status']}"
            out.append(Event(kind, cond["reason"], f"{cond['type']}={cond['status']}: {text}"))
        return out
