"""The operator never gives a job more than its submitter could have had (issue 29), against the real API server,
as a user who may create FineTuneJobs and nothing else (alice, by impersonation), in a namespace without
PodSecurity labels and in one enforcing `restricted`:

- refused at `kubectl apply` by the chart's job policy, naming the field: a hostPath of the node's `/`, a Secret
  volume, an image or a command the chart did not open;
- refused by the operator, naming the field, where that policy is not installed (the shared cluster): the job
  fails at once and no pod is ever made;
- a job that is allowed runs without the user's `app` label on its pod (which would make it an endpoint of
  another app's Service), without the disk group unless it is handed NVMe namespaces, and what its container
  writes into its termination message reaches the job's status only bounded, with credentials redacted.

(What the job's own token may write into its status: test_status_ownership.py.)
"""
from __future__ import annotations

import json
import subprocess
import uuid
from typing import Any

import pytest

from e2e.operator.harness import CHART, events_of, ftj, job, pods_of, wait

pytestmark = pytest.mark.cluster

USER = "alice"
KINDS = ["no-pod-security", "restricted"]
TOKEN = "eyJhbGciOiJSUzI1NiIsImtpZCI6Ik1ZIn0.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQifQ.c2lnbmF0dXJlLWJ5dGVz"
# What the job asks for beyond the chart's defaults -> the field the refusal names.
TOO_MUCH: list[tuple[dict[str, Any], str]] = [
    ({"volumes": [{"name": "root", "hostPath": {"path": "/"}}],
      "volumeMounts": [{"name": "root", "mountPath": "/host"}]}, "spec.volumes[0].hostPath: volume type hostPath"),
    ({"volumes": [{"name": "db", "secret": {"secretName": "db-password"}}],
      "volumeMounts": [{"name": "db", "mountPath": "/db"}]}, "spec.volumes[0].secret: volume type secret"),
    ({"image": "docker.io/library/busybox:1.36"}, "spec.image: docker.io/library/busybox:1.36 is not allowed"),
    ({"command": ["sh", "-c", "cat /db/* > /dev/termination-log"]}, "spec.command: a custom command is not allowed"),
]


def namespace_for(cluster: Any, ns: str, kind: str) -> str:
    """`ns`, enforcing `restricted` for that kind, where USER may do anything to FineTuneJobs and nothing else."""
    if kind == "restricted":
        cluster.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    rbac = "rbac.authorization.k8s.io"
    cluster.apply({"apiVersion": f"{rbac}/v1", "kind": "Role", "metadata": {"name": "finetunejobs-only"},
                   "rules": [{"apiGroups": ["memstrata.dev"], "resources": ["finetunejobs"],
                              "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}]},
                  {"apiVersion": f"{rbac}/v1", "kind": "RoleBinding", "metadata": {"name": "alice-finetunejobs"},
                   "roleRef": {"apiGroup": rbac, "kind": "Role", "name": "finetunejobs-only"},
                   "subjects": [{"apiGroup": rbac, "kind": "User", "name": USER}]}, namespace=ns)
    for verb, resource in (("create", "pods"), ("get", "secrets")):
        assert as_user(cluster, "auth", "can-i", verb, resource, "-n", ns).stdout.strip() == "no"
    return ns


def as_user(cluster: Any, *args: str, doc: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), f"--as={USER}",
                           *args], input=json.dumps(doc) if doc else None, capture_output=True, text=True, timeout=60)


def _asking(name: str, ask: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return job(name, **kw, **ask)


def test_the_charts_policy_refuses_at_apply_naming_the_field(quiet_cluster: Any) -> None:
    cluster = quiet_cluster
    cluster.kubectl("apply", "-f", "-", input=cluster.helm(
        "template", "memstrata", str(CHART), "--namespace", "memstrata-system", "--kube-version", "v1.36.4",
        "--show-only", "templates/job-policy.yaml"))
    for kind in KINDS:
        ns = f"policy-{kind}-{uuid.uuid4().hex[:5]}"
        cluster.create_namespace(ns)
        namespace_for(cluster, ns, kind)
        # The API server loads a new policy and its binding asynchronously (seconds, more on a busy machine). Wait
        # with a server-side dry run, which admission judges but which stores nothing: a real apply that went
        # through before the policy took effect would leave a job whose re-apply, no change to its spec, the
        # policy rightly lets pass.
        wait("the job policy in effect", lambda: "the chart's jobPolicy" in as_user(
            cluster, "apply", "--dry-run=server", "-n", ns, "-f", "-", doc=_asking("probe", TOO_MUCH[0][0])).stderr,
            timeout=90)
        for i, (ask, field) in enumerate(TOO_MUCH):
            refused = as_user(cluster, "apply", "-n", ns, "-f", "-", doc=_asking(f"too-much-{i}", ask))
            assert refused.returncode != 0, f"{field}: applied, not refused"
            assert field in refused.stderr and "the chart's jobPolicy" in refused.stderr, refused.stderr
        assert not cluster.get_json("finetunejobs", "-n", ns)["items"]
        allowed = as_user(cluster, "apply", "-n", ns, "-f", "-", doc=job("allowed"))
        assert allowed.returncode == 0, allowed.stderr
        # A change of an existing job is held to the policy too; a write that leaves the spec alone is not.
        changed = as_user(cluster, "patch", "ftj", "allowed", "-n", ns, "--type=merge",
                          "-p", json.dumps({"spec": {"image": "docker.io/library/busybox:1.36"}}))
        assert changed.returncode != 0 and "spec.image: docker.io/library/busybox:1.36" in changed.stderr
        assert as_user(cluster, "label", "ftj", "allowed", "-n", ns, "team=a").returncode == 0


@pytest.mark.parametrize("kind", KINDS)
def test_the_operator_refuses_what_the_policy_would_and_makes_no_pod(memstrata_cluster: Any, ns: str, nodes: Any,
                                                                      kind: str) -> None:
    cluster = memstrata_cluster
    namespace_for(cluster, ns, kind)
    nodes.add("gpu", dram_gib=64)
    for i, (ask, _) in enumerate(TOO_MUCH):
        made = as_user(cluster, "apply", "-n", ns, "-f", "-", doc=_asking(f"too-much-{i}", ask))
        assert made.returncode == 0, made.stderr  # no job policy on this cluster: the operator is the check
    for i, (_, field) in enumerate(TOO_MUCH):
        name = f"too-much-{i}"
        wait(f"{name} Failed", lambda: (ftj(cluster, ns, name).get("status") or {}).get("phase") == "Failed")
        failed = next(c for c in ftj(cluster, ns, name)["status"]["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "NotAllowed" and field in failed["message"], failed
        assert pods_of(cluster, ns, name) == []
    assert cluster.get_json("pods", "-n", ns)["items"] == []


@pytest.mark.parametrize("kind", KINDS)
def test_an_allowed_jobs_pod_gets_no_foreign_label_no_spare_group_and_its_output_is_sanitised(
        memstrata_cluster: Any, ns: str, nodes: Any, kind: str) -> None:
    cluster = memstrata_cluster
    namespace_for(cluster, ns, kind)
    nodes.add("gpu", dram_gib=64)
    doc = job("allowed", labels={"app": "web", "user.memstrata.dev/team": "a"}, run_policy={"backoffLimit": 0})
    made = as_user(cluster, "apply", "-n", ns, "-f", "-", doc=doc)
    assert made.returncode == 0, made.stderr
    pod = wait("the pod bound", lambda: (p := pods_of(cluster, ns, "allowed")) and p[0]["spec"].get("nodeName")
               and p[0])
    labels = pod["metadata"]["labels"]
    assert "app" not in labels and labels["user.memstrata.dev/team"] == "a", labels
    (container,) = pod["spec"]["containers"]
    nvme = int(container["resources"]["requests"].get("memstrata.dev/nvme-ns", 0))
    assert ("supplementalGroups" in pod["spec"]["securityContext"]) == bool(nvme), pod["spec"]["securityContext"]
    assert container["terminationMessagePolicy"] == "File"

    # The container ends, having written what it read into its termination message (as the kubelet reports it).
    wait("the pod Running", lambda: pods_of(cluster, ns, "allowed")[0]["status"].get("phase") == "Running")
    now = "2026-11-23T08:00:00Z"
    written = f"cat /var/run/secrets/kubernetes.io/serviceaccount/token:\n{TOKEN}\n" + "padding " * 600
    cluster.kubectl("patch", "pod", pod["metadata"]["name"], "-n", ns, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"phase": "Failed", "containerStatuses": [{
                        "name": container["name"], "image": container["image"], "imageID": "", "ready": False,
                        "restartCount": 0, "started": False, "state": {"terminated": {
                            "exitCode": 1, "reason": "Error", "message": written, "startedAt": now,
                            "finishedAt": now}}}]}}))
    wait("Failed", lambda: (ftj(cluster, ns, "allowed").get("status") or {}).get("phase") == "Failed")
    status = as_user(cluster, "get", "ftj", "allowed", "-n", ns, "-o", "json")
    assert status.returncode == 0, status.stderr
    last = json.loads(status.stdout)["status"]["lastFailure"]
    assert last["reason"] == "Error" and "[redacted]" in last["message"] and len(last["message"]) < 700, last
    assert TOKEN not in status.stdout and TOKEN[:40] not in status.stdout
    assert not any(TOKEN[:40] in e.get("message", "") for e in events_of(cluster, ns, "allowed"))
