"""The chart without a cluster (its CRD is the generated one: tests/api/test_crd.py): `helm lint --strict` is
clean, and the rendered operator meets the rules the API server will check (e2e/operator/test_chart.py checks them
there)."""
from __future__ import annotations

import pytest
import yaml
from helm_helpers import CHART, KUBE, run_helm

from memstrata.operator.jobpolicy import JobPolicy


def test_helm_lint_strict_is_clean(tmp_path):
    proc = run_helm("lint", "--strict", str(CHART), tmp=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_values_schema_rejects_a_misspelt_value_naming_it(tmp_path):
    proc = run_helm("template", "x", str(CHART), *KUBE, "--set", "operator.replica=3", tmp=tmp_path)
    assert proc.returncode != 0 and "replica" in proc.stderr


def test_rendered_operator_is_restricted_and_probed(tmp_path):
    proc = run_helm("template", "x", str(CHART), *KUBE, "--namespace", "memstrata-system", tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert c["securityContext"]["allowPrivilegeEscalation"] is False and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and "--liveness=http://0.0.0.0:8080/healthz" in c["args"]
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-operator"))
    verbs = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert "*" not in {v for vs in verbs.values() for v in vs}
    assert verbs[("", "nodes")] == {"get", "list", "watch"} and ("", "secrets") not in verbs
    agent = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert agent["containers"][0]["securityContext"]["privileged"] is True  # host block devices; see the template


@pytest.mark.parametrize("sets,expect", [
    ((), {"lease": "memstrata-operator", "lease_namespace": "memstrata-system", "gid": 6, "seccomp": "RuntimeDefault",
          "jobs": JobPolicy()}),
    (("operator.leaderElection.enabled=false", "operator.replicas=1", "trainingPod.deviceGroup=null",
      "trainingPod.seccompProfile=localhost/memstrata/io-uring.json", "jobPolicy.volumeTypes={nfs,csi}",
      "jobPolicy.images={registry.corp/ml/*}", "jobPolicy.customCommands=true"),
     {"lease": None, "lease_namespace": "default", "gid": None, "seccomp": "localhost/memstrata/io-uring.json",
      "jobs": JobPolicy(("nfs", "csi"), ("registry.corp/ml/*",), True)}),
])
def test_the_deployments_args_are_what_the_operator_accepts(tmp_path, sets, expect):
    """The chart's values become flags the operator's own parser takes, with the values meant."""
    from memstrata.operator.main import build_parser, config_from_args

    flags = [a for s in sets for a in ("--set", s)]
    proc = run_helm("template", "x", str(CHART), *KUBE, "--namespace", "memstrata-system", *flags, tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    dep = next(d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["args"][0] == "operator"
    config = config_from_args(build_parser().parse_args(c["args"][1:]))
    assert config.lease == expect["lease"] and config.lease_namespace == expect["lease_namespace"]
    assert config.pod_security.device_gid == expect["gid"]
    assert config.pod_security.seccomp_profile == expect["seccomp"]
    assert config.policy.jobs == expect["jobs"]  # what a job may ask for: the same values the job policy holds
    assert any(e["name"] == "POD_NAME" for e in c["env"])  # the replica's name in the Lease


@pytest.mark.parametrize("flags,on", [
    ((), False),  # auto, on a cluster without Kueue's API
    (("--api-versions", "kueue.x-k8s.io/v1beta2"), True),  # auto, with it
    (("--set", "kueue.enabled=false", "--api-versions", "kueue.x-k8s.io/v1beta2"), False),
    (("--set", "kueue.enabled=true"), True),
])
def test_kueue_gives_the_operator_its_flag_and_its_rights_on_workloads_together(tmp_path, flags, on):
    """The flag without the rights would fail every queued job's Workload create; the rights without the flag are
    rights unused."""
    from memstrata.operator.main import build_parser, config_from_args

    proc = run_helm("template", "x", str(CHART), *KUBE, "--namespace", "memstrata-system", *flags, tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    (c,) = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"]
    assert config_from_args(build_parser().parse_args(c["args"][1:])).policy.kueue is on
    rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    kueue = {res for r in rules if "kueue.x-k8s.io" in r["apiGroups"] for res in r["resources"]}
    assert kueue == ({"workloads", "workloads/status", "workloadpriorityclasses", "resourceflavors"} if on else set())
    # Kueue's controller reads FineTuneJobs (its pod webhook follows a pod's owner to an external framework's job).
    readers = [s for d in docs if d["kind"] == "ClusterRoleBinding" for s in d["subjects"]
               if s["name"] == "kueue-controller-manager"]
    assert readers == ([{"kind": "ServiceAccount", "name": "kueue-controller-manager", "namespace": "kueue-system"}]
                       if on else [])


def test_an_unknown_kueue_mode_is_refused_naming_the_value(tmp_path):
    proc = run_helm("template", "x", str(CHART), *KUBE, "--set", "kueue.enabled=yes", tmp=tmp_path)
    assert proc.returncode != 0 and "kueue/enabled" in proc.stderr, proc.stderr
