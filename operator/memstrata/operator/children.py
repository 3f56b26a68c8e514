"""The objects a job owns in its namespace: created for an attempt, deleted with the job.

Every child carries an ownerReference with the job's UID and is selected by that UID. An object
found under a child's name but not owned by this job is never adopted (patched, bound, deleted):
adopting a same-named ServiceAccount would let whoever may create a FineTuneJob run as that
account, and deleting the job would delete it.
"""
from __future__ import annotations

import asyncio
from typing import Any, Mapping

from memstrata.operator import names, render
from memstrata.operator.actions import CreateAttempt
from memstrata.operator.kube import Conflict, Kube, api_path, gather_ok, object_path
from memstrata.operator.observe import JobView

KINDS = (("v1", "pods"), ("v1", "configmaps"), ("rbac.authorization.k8s.io/v1", "rolebindings"),
         ("rbac.authorization.k8s.io/v1", "roles"), ("v1", "serviceaccounts"))


class NameClash(Exception):
    """An object the job needs exists under its name but belongs to someone else."""


async def create_attempt(kube: Kube, job: JobView, action: CreateAttempt, report_interval_seconds: float,
                         security: render.PodSecurity = render.PodSecurity()) -> None:
    before, pod = render.attempt_objects(job, action.node, action.plan, action.attempt, report_interval_seconds,
                                         security)
    account, role, binding, config = before

    # Only the ServiceAccount must exist before the pod (admission checks it); the ConfigMap,
    # Role and RoleBinding are created alongside: the kubelet waits for a missing volume, and
    # the Role is used only when the runtime first reports. The Role comes before its binding:
    # for any identity short of cluster-admin the API server checks a binding against its Role.
    async def rbac() -> None:
        await ensure(kube, job, role)
        await ensure(kube, job, binding)

    others = asyncio.create_task(gather_ok(rbac(), ensure(kube, job, config)))
    try:
        await ensure(kube, job, account)
        try:
            await kube.create(pod)
        except Conflict:
            await check_owned(kube, job, pod)  # ours: created by an earlier run of this same decision
    finally:
        await others


async def ensure(kube: Kube, job: JobView, obj: Mapping[str, Any]) -> None:
    """Create; if it exists and this job owns it (a re-run), converge it by apply."""
    try:
        await kube.create(obj)
    except Conflict:
        existing = await check_owned(kube, job, obj)
        # The version checked: if the object was swapped for another since, the apply gets a 409.
        version = (existing.get("metadata") or {}).get("resourceVersion")
        await kube.apply({**obj, "metadata": {**obj["metadata"], "resourceVersion": version}}, names.FIELD_MANAGER)


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(o.get("uid") == uid for o in (obj.get("metadata") or {}).get("ownerReferences") or [])


async def check_owned(kube: Kube, job: JobView, obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object now stored under obj's name; NameClash unless this job owns it."""
    existing = await kube.get(object_path(obj))
    owners = (existing.get("metadata") or {}).get("ownerReferences") or []
    if not owned_by(existing, job.uid):
        held = ", ".join(f"{o.get('kind')}/{o.get('name')}" for o in owners) or "nobody"
        raise NameClash(f"{obj['kind']} {job.namespace}/{obj['metadata']['name']} already exists and is not "
                        f"this job's (owned by {held}); memstrata never adopts an object it did not create "
                        "for this job: delete or rename that object, then re-create the job")
    return existing


async def delete_children(kube: Kube, namespace: str, uid: str) -> None:
    """Delete every child of the job with this UID (idempotent): selected by the UID label, so nothing
    another job or user owns is touched."""
    sel = names.selector(uid)
    await gather_ok(*(kube.delete_collection(api_path(api_version, plural, namespace), sel)
                      for api_version, plural in KINDS))
