"""The Helm chart against the real API server: every rendered object passes server-side validation,
and the operator's pod passes PodSecurity `restricted` with no warning at all."""
from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from e2e.operator.harness import CHART

pytestmark = pytest.mark.cluster


def _template(cluster, namespace: str, *values: str) -> list[dict]:
    out = cluster.helm("template", "memstrata", str(CHART), "--namespace", namespace, "--include-crds",
                       "--kube-version", "v1.36.4", *values)
    return [d for d in yaml.safe_load_all(out) if d]


def _kubectl(cluster, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), *args],
                          input=input, capture_output=True, text=True, timeout=120)


def test_rendered_chart_passes_server_side_dry_run(memstrata_cluster):
    cluster = memstrata_cluster
    ns = "memstrata-chart-dry"
    cluster.create_namespace(ns)
    try:
        for values in ((), ("--set", f"operator.watchNamespaces={{{ns}}}", "--set", "nodeAgent.enabled=false"),
                       ("--set", "nodeAgent.loopNamespaces={loop3,loop4}")):
            docs = _template(cluster, ns, *values)
            kinds = sorted({d["kind"] for d in docs})
            assert {"Deployment", "ClusterRole", "ClusterRoleBinding", "ServiceAccount",
                    "CustomResourceDefinition"} <= set(kinds), kinds
            # --force-conflicts: the session installed the same CRD with kubectl's field manager.
            proc = _kubectl(cluster, "apply", "--server-side", "--force-conflicts", "--dry-run=server",
                            "--field-manager=helm",
                            "-n", ns, "-f", "-",
                            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
            assert proc.returncode == 0, proc.stderr
            assert "warning" not in proc.stderr.lower(), proc.stderr
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_operator_pod_is_admitted_under_restricted_pod_security_without_warnings(memstrata_cluster):
    cluster = memstrata_cluster
    ns = "memstrata-restricted"
    cluster.create_namespace(ns)
    try:
        for mode in ("enforce", "warn", "audit"):
            cluster.kubectl("label", "namespace", ns, f"pod-security.kubernetes.io/{mode}=restricted",
                            f"pod-security.kubernetes.io/{mode}-version=latest", "--overwrite")
        docs = _template(cluster, ns)
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        account = next(d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"].endswith("-operator"))
        cluster.apply(account)  # admission checks that the pod's ServiceAccount exists
        template = deployment["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "operator-probe", "namespace": ns, "labels": template["metadata"]["labels"]},
               "spec": template["spec"]}
        proc = _kubectl(cluster, "create", "--dry-run=server", "-f", "-", input=json.dumps(pod))
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.strip() == "", f"PodSecurity said something: {proc.stderr}"

        # The check is real: the node agent's pod is refused in the same namespace.
        daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
        agent = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "agent-probe", "namespace": ns},
                 "spec": {**daemonset["spec"]["template"]["spec"], "serviceAccountName": "default",
                          "priorityClassName": None}}
        refused = _kubectl(cluster, "create", "--dry-run=server", "-f", "-", input=json.dumps(agent))
        assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr
        assert "privileged" in refused.stderr and "hostPID" in refused.stderr
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false")
