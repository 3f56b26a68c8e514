"""The operator's own status fields (memstrata.api.jobstatus), read back so that garbage is never acted on. Pure.

They are its memory of what it cannot observe: the current attempt (activePod), the failed ones (failedPods), how
many were made (attempts). A value that does not read as declared (stored before the CRD's schema declared it), or
one that names no pod of this job (a hand edit, `activePod: zzz`), was acted on: "abc" counted as three failed
pods, a current attempt that never existed as one that disappeared (either failed the job and deleted its running
pod), `attempts: x` stopped every reconcile. Such a field reads as absent: the lifecycle goes by the pods it
observes (the job's, by owner reference), and its next status patch removes the field, with a warning event that
names it (memstrata.operator.conditions). status.plan is read here once, typed, for the rule that acts on it
(memstrata.operator.gang.rest).
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from memstrata.api.jobstatus import read_fields, wire_fields
from memstrata.api.strataplan import Plan
from memstrata.operator.names import attempt_of


class Read(NamedTuple):
    status: dict[str, Any]  # as the job holds it, the operator's fields that do not read taken out
    malformed: dict[str, str]  # per field taken out, why
    plan: Plan | None  # status.plan, typed


def read(job: str, status: Mapping[str, Any]) -> Read:
    """`status` with the operator's fields as they read and those that do not read taken out (failedPods: only its
    entries that name no pod of the job); per field taken out, why; and the plan it records."""
    own, problems = read_fields(status)
    values = wire_fields(own)
    out = {k: v for k, v in status.items() if k not in problems}
    out.update(values)
    failed = values.get("failedPods")
    strays = [n for n in failed or [] if attempt_of(job, n) is None]
    if strays:
        problems["failedPods"] = f"status.failedPods: {', '.join(map(repr, strays))} names no pod of job {job}"
        out["failedPods"] = [n for n in failed or [] if n not in strays]
        if not out["failedPods"]:
            del out["failedPods"]
    active = values.get("activePod")
    if active is not None:
        attempt, made = attempt_of(job, active), values.get("attempts")
        if attempt is None:
            problems["activePod"] = f"status.activePod: {active!r} names no pod of job {job}"
        elif made is not None and attempt >= made:  # both are written in one patch, attempts past activePod's
            problems["activePod"] = (f"status.activePod: {active!r} is attempt {attempt + 1}, but status.attempts "
                                     f"says {made} were made")
        if "activePod" in problems:
            del out["activePod"]
    return Read(out, problems, own.plan)
