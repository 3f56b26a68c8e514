"""The chart's RBAC and admission policies as rendered by `helm template` (no cluster): with
operator.watchNamespaces set the operator holds its job rules in a Role per watched namespace and
only reads cluster-wide; leader election is one Lease in the release namespace; Kopf peering is gone;
the node agent's ValidatingAdmissionPolicy names its ServiceAccount and the label prefix the agent
writes. e2e/operator/test_rbac.py checks the same on the real API server."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from memstrata.api.inventory import PREFIX, NodeInventory, render_node
from memstrata.operator import render
from memstrata.operator.observe import job_view

from helm_helpers import CHART, KUBE, REPO, run_helm
NS = "memstrata-system"
OPERATOR = "memstrata-operator"  # release "memstrata": the full name is the chart's name
AGENT = "memstrata-node-agent"
READ = {"get", "list", "watch"}


def _render(tmp: Path, *values: str) -> list[dict[str, Any]]:
    proc = run_helm("template", "memstrata", str(CHART), *KUBE, "--namespace", NS, "--include-crds", *values, tmp=tmp)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _one(docs: list[dict[str, Any]], kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name
             and d["metadata"].get("namespace") == namespace]
    assert len(found) == 1, f"{kind} {namespace}/{name}: {len(found)} rendered"
    return found[0]


def _grants(rules: list[dict[str, Any]], group: str, resource: str, verb: str, name: str | None = None) -> bool:
    """What the RBAC authorizer would answer for one request (resourceNames: the request's object name)."""
    return any((group in r.get("apiGroups", []) or "*" in r.get("apiGroups", []))
               and (resource in r.get("resources", []) or "*" in r.get("resources", []))
               and (verb in r["verbs"] or "*" in r["verbs"])
               and (not r.get("resourceNames") or (name is not None and name in r["resourceNames"]))
               for r in rules)


def _job_objects() -> list[dict[str, Any]]:
    """Everything the operator creates for one attempt of one job (memstrata.operator.render)."""
    body = yaml.safe_load((REPO / "examples" / "finetune-tiny.yaml").read_text())
    body["metadata"] = {"name": "j", "namespace": "team-a", "uid": "00000000-0000-0000-0000-000000000001"}
    view = job_view(body)
    assert view.spec is not None, view.spec_error
    from memstrata.plan import plan_job

    inv = NodeInventory.model_validate({"hostname": "n1", "numaNodes": [{"id": 0, "memoryBytes": "512Gi"}],
                                        "gpus": [{"index": 0, "hbmBytes": "80Gi"}]})
    companions, (pod,) = render.gang_objects(view, ("n1",), plan_job(view.spec, inv), attempt=0)
    # A job on two nodes adds its headless Service and a second pod.
    body["spec"]["resources"]["nodes"] = 2
    gang = job_view(body)
    assert gang.spec is not None, gang.spec_error
    more, pods = render.gang_objects(gang, ("n1", "n2"), plan_job(gang.spec, inv), attempt=0)
    return [*companions, pod, *more, *pods]


def _can_make_a_job(rules: list[dict[str, Any]]) -> list[str]:
    """What of one job's objects these rules would not let the operator create; RBAC lets it create a
    Role (or bind one) only with every rule of that Role held itself, in that namespace."""
    missing = []
    for obj in _job_objects():
        group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
        plural = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
                  "ConfigMap": "configmaps", "Pod": "pods", "Service": "services"}[obj["kind"]]
        # create, and what the operator does to it after: converge it on a re-run, delete it with the job.
        for verb in ("create", "delete") + (("get", "patch") if plural != "pods" else ()):
            if not _grants(rules, group, plural, verb):
                missing.append(f"{verb} {plural}")
        for rule in obj.get("rules", []):  # the escalation check
            for g in rule["apiGroups"]:
                for res in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames") or [None]:
                            if not _grants(rules, g, res, verb, name):
                                missing.append(f"{verb} {res}.{g} {name} (granted to the job's runtime)")
    return missing


def test_the_operators_job_rules_are_cluster_wide_or_a_role_in_each_watched_namespace(tmp_path: Path) -> None:
    # Without watchNamespaces it serves the cluster: the ClusterRole holds what a job needs.
    docs = _render(tmp_path)
    rules = _one(docs, "ClusterRole", OPERATOR)["rules"]
    assert not _can_make_a_job(rules), _can_make_a_job(rules)
    assert not [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == OPERATOR]
    binding = _one(docs, "ClusterRoleBinding", OPERATOR)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPERATOR, "namespace": NS}]

    # With them, a Role in each, and cluster-wide only reads.
    docs = _render(tmp_path, "--set", "operator.watchNamespaces={team-a,team-b}")
    cluster_rules = _one(docs, "ClusterRole", OPERATOR)["rules"]
    for rule in cluster_rules:
        assert set(rule["verbs"]) <= READ, f"cluster-wide {rule['verbs']} on {rule['resources']}"
    assert {r for rule in cluster_rules for r in rule["resources"]} == {
        "nodes", "customresourcedefinitions", "namespaces"}
    assert not _grants(cluster_rules, "", "pods", "create") and not _grants(cluster_rules, "rbac.authorization.k8s.io",
                                                                              "rolebindings", "create")
    for ns in ("team-a", "team-b"):
        rules = _one(docs, "Role", OPERATOR, ns)["rules"]
        assert not _can_make_a_job(rules), (ns, _can_make_a_job(rules))
        for group, resource, verbs in (("memstrata.dev", "finetunejobs", READ | {"patch", "delete"}),
                                       ("memstrata.dev", "finetunejobs/status", {"get", "patch"}),
                                       ("", "pods", READ | {"delete", "deletecollection"}),
                                       ("", "events", {"create", "patch"}), ("events.k8s.io", "events", {"create"})):
            for verb in verbs:
                assert _grants(rules, group, resource, verb), (ns, verb, resource)
        binding = _one(docs, "RoleBinding", OPERATOR, ns)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": OPERATOR}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPERATOR, "namespace": NS}]
    # The Deployment serves exactly those namespaces.
    args = _one(docs, "Deployment", OPERATOR, NS)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]


def test_a_namespace_listed_twice_is_refused(tmp_path: Path) -> None:
    proc = run_helm("template", "memstrata", str(CHART), *KUBE, "--set", "operator.watchNamespaces={a,a}",
                     tmp=tmp_path)
    assert proc.returncode != 0 and "watchNamespaces" in proc.stderr


def test_leader_election_is_one_lease_in_the_release_namespace(tmp_path: Path) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]
    assert "peeringName" not in values
    assert values["leaderElection"] == {"enabled": True, "leaseName": "memstrata-operator", "leaseDurationSeconds": 15,
                                        "renewDeadlineSeconds": 10, "retryPeriodSeconds": 2}
    docs = _render(tmp_path, "--set", "operator.watchNamespaces={team-a}",
                   "--set", "operator.leaderElection.leaseName=ops")
    rules = _one(docs, "Role", f"{OPERATOR}-leader-election", NS)["rules"]
    assert _grants(rules, "coordination.k8s.io", "leases", "get", "ops")
    assert _grants(rules, "coordination.k8s.io", "leases", "update", "ops")
    assert _grants(rules, "coordination.k8s.io", "leases", "create")  # create has no name to check
    assert not _grants(rules, "coordination.k8s.io", "leases", "update", "memstrata-operator")
    assert not _grants(rules, "coordination.k8s.io", "leases", "delete", "ops")
    assert not _grants(rules, "coordination.k8s.io", "leases", "list")
    binding = _one(docs, "RoleBinding", f"{OPERATOR}-leader-election", NS)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPERATOR, "namespace": NS}]
    assert binding["roleRef"]["name"] == f"{OPERATOR}-leader-election"
    # Leases only there: neither cluster-wide nor in the watched namespace.
    for role in (_one(docs, "ClusterRole", OPERATOR), _one(docs, "Role", OPERATOR, "team-a")):
        assert not _grants(role["rules"], "coordination.k8s.io", "leases", "create")

    docs = _render(tmp_path, "--set", "operator.leaderElection.enabled=false", "--set", "operator.replicas=1")
    assert not [d for d in docs if d["metadata"]["name"].endswith("-leader-election")]


def test_leader_election_settings_that_could_not_work_are_refused(tmp_path: Path) -> None:
    base = ("template", "memstrata", str(CHART), *KUBE)
    # Without a Lease every replica would act.
    proc = run_helm(*base, "--set", "operator.leaderElection.enabled=false", tmp=tmp_path)
    assert proc.returncode != 0 and "/operator/replicas" in proc.stderr, proc.stderr
    # The holder must stop acting before another replica may take over.
    proc = run_helm(*base, "--set", "operator.leaderElection.renewDeadlineSeconds=20", tmp=tmp_path)
    assert proc.returncode != 0 and "retryPeriodSeconds (2) < renewDeadlineSeconds (20) < leaseDurationSeconds (15)" \
        in proc.stderr, proc.stderr
    proc = run_helm(*base, "--set", "operator.leaderElection.leaseName=Not_A_Name", tmp=tmp_path)
    assert proc.returncode != 0 and "leaseName" in proc.stderr
    proc = run_helm(*base, "--set", "operator.peeringName=memstrata", tmp=tmp_path)
    assert proc.returncode != 0 and "peeringName" in proc.stderr


def test_kopf_peering_is_gone_from_the_chart(tmp_path: Path) -> None:
    for values in ((), ("--set", "operator.watchNamespaces={team-a}")):
        docs = _render(tmp_path, *values)
        assert not [d for d in docs if "kopf" in d["apiVersion"] or "kopf" in d["metadata"]["name"]]
        for d in docs:
            for rule in d.get("rules", []):
                assert "kopf.dev" not in rule["apiGroups"], (d["kind"], d["metadata"]["name"])
    assert not (CHART / "crds" / "kopfpeering.yaml").exists() and not (CHART / "templates" / "peering.yaml").exists()


def test_the_node_agent_policy_names_its_service_account_and_what_it_writes(tmp_path: Path) -> None:
    docs = _render(tmp_path)
    daemonset = _one(docs, "DaemonSet", AGENT, NS)
    account = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    _one(docs, "ServiceAccount", account, NS)
    policy = _one(docs, "ValidatingAdmissionPolicy", AGENT)["spec"]
    assert policy["failurePolicy"] == "Fail"
    assert policy["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["*"], "operations": ["UPDATE"], "resources": ["nodes"]}]
    (condition,) = policy["matchConditions"]
    assert condition["expression"] == f"request.userInfo.username == 'system:serviceaccount:{NS}:{account}'"
    text = json.dumps(policy)
    assert "request.userInfo.extra['authentication.kubernetes.io/node-name']" in text
    assert "== object.metadata.name" in text
    # The prefix the policy lets it change is the one render_node writes every label and annotation under.
    prefixes = set(re.findall(r"startsWith\('([^']*)'\)", text))
    assert prefixes == {f"{PREFIX}/"}
    inv = NodeInventory.model_validate({"hostname": "n1", "numaNodes": [{"id": 0, "memoryBytes": "64Gi"}]})
    node = render_node(inv)
    assert all(k.startswith(f"{PREFIX}/") for k in [*node["labels"], *node["annotations"]])
    binding = _one(docs, "ValidatingAdmissionPolicyBinding", AGENT)["spec"]
    assert binding == {"policyName": AGENT, "validationActions": ["Deny"]}
    # RBAC still grants patch on nodes (it cannot name one); the policy is what narrows it.
    role = _one(docs, "ClusterRole", AGENT)
    # Under DRA (the default where resource.k8s.io/v1 is served) also its slice, which a second policy narrows to
    # its own node's, and the claims it prepares, read only.
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"],
         "verbs": ["get", "create", "update"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]}]
    slices = _one(docs, "ValidatingAdmissionPolicy", f"{AGENT}-slices")["spec"]
    assert slices["matchConditions"] == policy["matchConditions"]
    assert "variables.slice.spec.nodeName == variables.tokenNode" in json.dumps(slices)
    plugin = _render(tmp_path, "--set", "nodeAgent.deviceApi=device-plugin")
    assert _one(plugin, "ClusterRole", AGENT)["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    assert not [d for d in plugin if d["metadata"]["name"] == f"{AGENT}-slices"]

    docs = _render(tmp_path, "--set", "nodeAgent.enabled=false")
    assert not [d for d in docs if d["metadata"]["name"] == AGENT]
