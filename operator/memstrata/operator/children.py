"""The objects a job owns in its namespace: created for an attempt, deleted with the job.

Every child carries an ownerReference with the job's UID and is selected by that UID. An object
found under a child's name but not owned by this job is never adopted (patched, bound, deleted):
adopting a same-named ServiceAccount would let whoever may create a FineTuneJob run as that
account, and deleting the job would delete it.
"""
from __future__ import annotations

import asyncio
from typing import Any, Mapping

from memstrata.operator import inspection, names, render
from memstrata.operator.actions import CreateAttempt
from memstrata.operator.kube import Conflict, Kube, KubeError, NotLeading, api_path, gather_ok, object_path
from memstrata.operator.observe import JobView

KINDS = (("v1", "pods"), ("v1", "configmaps"), ("rbac.authorization.k8s.io/v1", "rolebindings"),
         ("rbac.authorization.k8s.io/v1", "roles"), ("v1", "serviceaccounts"), ("v1", "services"))


class NameClash(Exception):
    """An object the job needs exists under its name but belongs to someone else."""


class PodRejected(Exception):
    """The API server refused the job's pod as invalid (422: a bad spec.volumes source, say) or as breaking
    the namespace's Pod Security level (403: a hostPath volume under `restricted`). The same pod would be
    refused on every retry, so the job fails with the API server's message."""


class PartlyCreated(Exception):
    """Some of a multi-node attempt's pods exist, a create of another failed (its error's text): the attempt is
    to be completed, not made anew (memstrata.operator.gang.rest)."""


class NothingCreated(Exception):
    """No pod of the attempt could be created, for a reason a later try may not meet (its error's text: a
    ResourceQuota's refusal, a timeout): the job says why it waits (memstrata.operator.gang.unfinished)."""


def _refused_for_good(exc: KubeError) -> bool:
    # A 403 is also what missing RBAC gives, which an admin can fix while the job waits: only PodSecurity's
    # refusal is about the pod itself.
    return exc.status == 422 or (exc.status == 403 and "violates PodSecurity" in (exc.message or ""))


async def create_pod(kube: Kube, job: JobView, pod: dict[str, Any]) -> None:
    """Create one of the job's pods; an existing one of this job's is fine (an earlier run of the same
    decision), another's is a NameClash, and an invalid one a PodRejected."""
    try:
        await kube.create(pod)
    except Conflict:
        await check_owned(kube, job, pod)
    except KubeError as exc:
        if not _refused_for_good(exc):
            raise
        # The pod's spec.volumes and its container's first volumeMounts are the job's, in the job's order
        # (render.user_volumes), so the API server's field paths name the job's fields.
        raise PodRejected(f"the API server refused pod {pod['metadata']['name']}: {exc.message}") from None


async def create_attempt(kube: Kube, job: JobView, action: CreateAttempt, report_interval_seconds: float,
                         security: render.PodSecurity = render.PodSecurity()) -> None:
    before, pods = render.gang_objects(job, action.placed, action.plan, action.attempt, report_interval_seconds,
                                       security, action.architecture)
    account, role, binding, config, *early = before  # early: a gang's Service, a DRA claim template

    # Only the ServiceAccount must exist before the pod (admission checks it); the ConfigMap,
    # Role and RoleBinding are created alongside: the kubelet waits for a missing volume, and
    # the Role is used only when the runtime first reports. The Role comes before its binding:
    # for any identity short of cluster-admin the API server checks a binding against its Role.
    async def rbac() -> None:
        await ensure(kube, job, role)
        await ensure(kube, job, binding)

    others = asyncio.create_task(gather_ok(rbac(), ensure(kube, job, config)))
    try:
        # A multi-node job's Service (created, or re-pointed at this attempt: its selector names it) and the
        # claim template its pods name come before the pods too: a reconcile that finds the attempt's pods would
        # never create them.
        await gather_ok(ensure(kube, job, account), *(ensure(kube, job, s) for s in early))
        made = await asyncio.gather(*(create_pod(kube, job, pods[r]) for r, _ in action.creates),
                                    return_exceptions=True)
        errors = [e for e in made if isinstance(e, BaseException)]
        # A pod refused for good, a name clash, lost leadership (or a cancellation) decide what comes next.
        final = [e for e in errors if isinstance(e, (NameClash, PodRejected, NotLeading))
                 or not isinstance(e, Exception)]
        if errors and not final:
            partly = len(errors) < len(made) or bool(action.ranks)
            raise (PartlyCreated if partly else NothingCreated)(str(errors[0])) from errors[0]
        if final:
            raise final[0]
    except BaseException:
        await asyncio.gather(others, return_exceptions=True)  # its own error comes second to this one
        raise
    await others


async def create_inspection(kube: Kube, job: JobView, security: render.PodSecurity = render.PodSecurity()) -> None:
    """The model inspection pod: it has no companions (no token, no config)."""
    await create_pod(kube, job, inspection.pod(job, security))


# Kinds whose spec the API server never lets change: a re-run finds the one it made, and that is all.
IMMUTABLE = frozenset({"ResourceClaimTemplate"})


async def ensure(kube: Kube, job: JobView, obj: Mapping[str, Any]) -> None:
    """Create; if it exists and this job owns it (a re-run), converge it by apply (an immutable kind: keep it)."""
    try:
        await kube.create(obj)
    except Conflict:
        existing = await check_owned(kube, job, obj)
        if obj["kind"] in IMMUTABLE:
            return
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
