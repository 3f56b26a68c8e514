"""The chart's RBAC and admission policies on the real API server, installed as a user installs it
(`helm template` with operator.watchNamespaces set, applied whole) on a control plane of its own:

- the node agent's token — a token bound to the agent's pod, which the API server stamps with the
  pod's node — may patch the memstrata.dev/ labels and annotation of that node, and is refused on
  another node, on other labels and on the node's spec (the chart's ValidatingAdmissionPolicy);
- the operator's ServiceAccount creates a job's objects in a watched namespace and nothing in
  another: no pod, no RoleBinding; it reads nodes cluster-wide and writes only its own Lease;
- the real operator, authenticated as that ServiceAccount with the Deployment's own arguments,
  runs a job in the watched namespace and leaves the other namespace's job alone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster.controlplane import ControlPlane, ControlPlaneError, bin_dir_from_env
from e2e.kueue.peer import install_crds, kueue_dir_from_env
from e2e.operator.harness import CHART, REPO, inventory, job, memstrata_node

pytestmark = pytest.mark.cluster

RELEASE_NS = "memstrata-system"
WATCHED, OTHER = "team-a", "team-b"
OPERATOR = "memstrata-operator"  # release "memstrata": the chart's full name is the release name
AGENT = "memstrata-node-agent"
LEASE = "memstrata-operator"  # operator.leaderElection.leaseName's default
NODE_A, NODE_B = "rbac-node-a", "rbac-node-b"


def unavailable(reason: str) -> None:
    """Skip what this machine cannot run; under CI=true fail instead, so that a CI runner that lost the
    control-plane binaries never passes by proving nothing."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but this test cannot run here: {reason}")
    pytest.skip(reason)


class Installed:
    """A control plane with the chart applied (release `memstrata` in RELEASE_NS, watching WATCHED)."""

    def __init__(self, cp: ControlPlane, docs: list[dict[str, Any]]) -> None:
        self.cp, self.docs = cp, docs
        raw = json.loads(cp.kubectl("config", "view", "--raw", "--minify", "-o", "json"))
        self._cluster_entry = raw["clusters"][0]["cluster"]

    def kubeconfig(self, token: str, path: Path) -> Path:
        """A kubeconfig that authenticates with `token` and nothing else."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "e2e", "cluster": self._cluster_entry}],
            "users": [{"name": "t", "user": {"token": token}}],
            "contexts": [{"name": "t", "context": {"cluster": "e2e", "user": "t"}}]}))
        return path

    def token(self, account: str, *bound: str) -> str:
        return self.cp.kubectl("create", "token", account, "-n", RELEASE_NS, "--duration=1h", *bound).strip()

    def kubectl_with(self, kubeconfig: Path, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.cp.bin_dir / "kubectl"), "--kubeconfig", str(kubeconfig), *args],
                              input=input, capture_output=True, text=True, timeout=60)

    def agent_pod(self, node: str) -> str:
        """The DaemonSet's pod on `node`, once the scheduler has bound it there."""
        found: list[str] = []

        def bound() -> bool:
            pods = self.cp.get_json("pods", "-n", RELEASE_NS, "-l", "app.kubernetes.io/component=node-agent",
                                    "--field-selector", f"spec.nodeName={node}")["items"]
            found[:] = [p["metadata"]["name"] for p in pods]
            return bool(found)

        self.cp.wait_for(f"the node agent's pod on {node}", bound, timeout=60)
        return found[0]


@pytest.fixture(scope="module")
def installed(request: pytest.FixtureRequest) -> Iterator[Installed]:
    bin_dir, reason = bin_dir_from_env()
    if bin_dir is None:
        unavailable(f"no real control plane: {reason}")
    assert bin_dir is not None
    cp = ControlPlane(bin_dir)
    cp.start()
    failed, failed_before = False, request.session.testsfailed
    try:
        for ns in (RELEASE_NS, WATCHED, OTHER):
            cp.create_namespace(ns)
        # Two memstrata nodes (each can hold one job) that kwok runs; the DaemonSet puts an agent on each.
        cp.create(*(memstrata_node(n, inventory(n, dram_gib=64)) for n in (NODE_A, NODE_B)))
        # Kueue's CRDs, as a cluster with Kueue has them: the chart's kueue.enabled=auto then gives the operator
        # --kueue and its rights on Workloads.
        kueue_dir, reason = kueue_dir_from_env(to_run=False)
        if kueue_dir is None:
            unavailable(reason)
        assert kueue_dir is not None
        install_crds(cp, kueue_dir / "share" / "kueue")
        rendered = cp.helm("template", "memstrata", str(CHART), "--namespace", RELEASE_NS, "--include-crds",
                           "--kube-version", "v1.36.4", "--api-versions", "kueue.x-k8s.io/v1beta2",
                           "--set", f"operator.watchNamespaces={{{WATCHED}}}")
        docs = [d for d in yaml.safe_load_all(rendered) if d]
        cp.kubectl("apply", "--server-side", "-f", "-", input=rendered)
        cp.wait_established("finetunejobs.memstrata.dev")
        yield Installed(cp, docs)
    except BaseException:
        failed = True
        raise
    finally:
        failed = failed or request.session.testsfailed > failed_before
        if failed:  # the component logs usually say why
            print(f"\n[rbac] control plane logs kept in {cp.workdir}\n{cp.logs_tail()}")
        cp.stop(keep_workdir=failed)


def _labels(cp: ControlPlane, node: str) -> dict[str, str]:
    return cp.get_json("node", node)["metadata"].get("labels", {})


def test_the_node_agents_token_patches_its_own_node_only(installed: Installed, tmp_path: Path) -> None:
    try:
        import kubernetes
    except ImportError as exc:
        unavailable(f"the node agent's dependencies are not installed ({exc}); run `make install`")
    from memstrata.nodeagent.labels import node_patch
    from memstrata.nodeagent.main import NodePatcher

    cp = installed.cp
    pod_a = installed.agent_pod(NODE_A)
    # What the kubelet mounts into the agent's pod: a token bound to that pod, hence naming its node.
    token_a = installed.token(AGENT, "--bound-object-kind", "Pod", "--bound-object-name", pod_a)
    as_a = installed.kubeconfig(token_a, tmp_path / "agent-a")
    who = json.loads(installed.kubectl_with(as_a, "auth", "whoami", "-o", "json").stdout)["status"]["userInfo"]
    assert who["extra"]["authentication.kubernetes.io/node-name"] == [NODE_A], who

    # The agent's own code, with its own patch: a node that grew to 96 GiB of DRAM.
    NodePatcher(NODE_A, str(as_a)).apply(inventory(NODE_A, dram_gib=96))
    assert _labels(cp, NODE_A)["memstrata.dev/dram-gib"] == "96"

    # The same agent on another node's inventory: refused, and node B keeps its labels.
    before = _labels(cp, NODE_B)
    with pytest.raises(kubernetes.client.ApiException) as refused:
        NodePatcher(NODE_B, str(as_a)).apply(inventory(NODE_B, dram_gib=1))
    assert refused.value.status == 403, refused.value
    assert f"the memstrata node agent on node {NODE_A} may change only that Node, not {NODE_B}" \
        in str(refused.value.body)
    assert _labels(cp, NODE_B) == before

    # On its own node: only what it owns.
    patch = json.dumps(node_patch(inventory(NODE_A, dram_gib=128)))
    for body, why in ((json.dumps({"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}}),
                       "only memstrata.dev/ labels"),
                      (json.dumps({"metadata": {"annotations": {"example.com/owner": "the-agent"}}}),
                       "only memstrata.dev/ annotations"),
                      (json.dumps({"spec": {"unschedulable": True}}), "not its spec"),
                      (json.dumps({"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}}), "not its spec")):
        denied = installed.kubectl_with(as_a, "patch", "node", NODE_A, "--type=merge", "-p", body)
        assert denied.returncode != 0 and why in denied.stderr, (body, denied.stderr)
    removed = installed.kubectl_with(as_a, "label", "node", NODE_A, "type-")
    assert removed.returncode != 0 and "only memstrata.dev/ labels" in removed.stderr, removed.stderr
    labels = _labels(cp, NODE_A)
    assert "node-role.kubernetes.io/control-plane" not in labels and labels["type"] == "kwok"
    assert cp.get_json("node", NODE_A)["spec"].get("unschedulable") is not True

    # The agent on node B may patch node B — and the merge patch the agent sends, sent by kubectl, works too.
    as_b = installed.kubeconfig(
        installed.token(AGENT, "--bound-object-kind", "Pod", "--bound-object-name", installed.agent_pod(NODE_B)),
        tmp_path / "agent-b")
    ok = installed.kubectl_with(as_b, "patch", "node", NODE_B, "--type=merge",
                                "-p", json.dumps(node_patch(inventory(NODE_B, dram_gib=32))))
    assert ok.returncode == 0, ok.stderr
    assert _labels(cp, NODE_B)["memstrata.dev/dram-gib"] == "32"
    assert installed.kubectl_with(as_b, "patch", "node", NODE_A, "--type=merge", "-p", patch).returncode != 0

    # A token of the same ServiceAccount that no pod holds names no node: it may change no Node.
    unbound = installed.kubeconfig(installed.token(AGENT), tmp_path / "agent-unbound")
    denied = installed.kubectl_with(unbound, "patch", "node", NODE_A, "--type=merge", "-p", patch)
    assert denied.returncode != 0 and "this token names no node" in denied.stderr, denied.stderr
    assert _labels(cp, NODE_A)["memstrata.dev/dram-gib"] == "96"


def _create(installed: Installed, kubeconfig: Path, obj: dict[str, Any], ns: str) -> subprocess.CompletedProcess[str]:
    return installed.kubectl_with(kubeconfig, "create", "-n", ns, "-f", "-", input=json.dumps(obj))


def _job_objects(ns: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """What the operator creates for one attempt of one job (its ServiceAccount, Role, RoleBinding,
    ConfigMap and pod), as memstrata.operator.render makes them."""
    from memstrata.operator.observe import job_view
    from memstrata.operator.render import gang_objects
    from memstrata.plan import plan_job

    body = job("by-hand")
    body["metadata"].update(namespace=ns, uid="5e1f0000-0000-4000-8000-000000000001")
    view = job_view(body)
    assert view.spec is not None, view.spec_error
    companions, (pod,) = gang_objects(view, (NODE_A,), plan_job(view.spec, inventory(NODE_A, dram_gib=64)), attempt=0)
    return companions, pod


def test_the_operator_writes_in_the_watched_namespace_only(installed: Installed, tmp_path: Path,
                                                           request: pytest.FixtureRequest) -> None:
    cp = installed.cp
    as_op = installed.kubeconfig(installed.token(OPERATOR), tmp_path / "operator")

    # Everything one attempt of a job needs, in the watched namespace — the RoleBinding included,
    # which RBAC allows only because the operator holds there every rule it grants the runtime.
    companions, pod = _job_objects(WATCHED)
    mine = [*companions, pod]
    request.addfinalizer(lambda: cp.kubectl("delete", "-n", WATCHED, "--ignore-not-found", "-f", "-",
                                            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": mine})))
    for obj in mine:
        deadline = time.monotonic() + 10
        while True:
            made = _create(installed, as_op, obj, WATCHED)
            # A RoleBinding right after its Role: the API server resolves the Role from its cache.
            if made.returncode == 0 or "NotFound" not in made.stderr or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert made.returncode == 0, (obj["kind"], made.stderr)
    # ...but never more than it holds itself.
    escalate = installed.kubectl_with(as_op, "create", "rolebinding", "grab", "-n", WATCHED, "--clusterrole=admin",
                                      f"--serviceaccount={WATCHED}:default")
    assert escalate.returncode != 0 and "not currently held" in escalate.stderr, escalate.stderr

    # In a namespace it does not watch: nothing at all.
    companions, pod = _job_objects(OTHER)
    for obj in [*companions, pod]:
        refused = _create(installed, as_op, obj, OTHER)
        plural = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
                  "ConfigMap": "configmaps", "Pod": "pods"}[obj["kind"]]
        assert refused.returncode != 0, f"the operator created a {obj['kind']} in {OTHER}"
        assert f'cannot create resource "{plural}"' in refused.stderr and f'namespace "{OTHER}"' in refused.stderr, \
            refused.stderr
    for args in (("get", "pods", "-n", OTHER), ("get", "pods", "--all-namespaces"),
                 ("get", "finetunejobs", "-n", OTHER), ("delete", "pods", "--all", "-n", OTHER)):
        refused = installed.kubectl_with(as_op, *args)
        assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), (args, refused.stderr)

    # Kueue: a job's Workload and its status in the watched namespace; WorkloadPriorityClasses and ResourceFlavors
    # read cluster-wide; no Workload elsewhere.
    for verb, resource, where in (("create", "workloads.kueue.x-k8s.io", WATCHED),
                                  ("patch", "workloads.kueue.x-k8s.io/status", WATCHED),
                                  ("watch", "workloads.kueue.x-k8s.io", WATCHED),
                                  ("get", "workloadpriorityclasses.kueue.x-k8s.io", None),
                                  ("get", "resourceflavors.kueue.x-k8s.io", None)):
        can = installed.kubectl_with(as_op, "auth", "can-i", verb, resource, *(["-n", where] if where else []))
        assert can.stdout.strip() == "yes", (verb, resource, can.stdout, can.stderr)
    can = installed.kubectl_with(as_op, "auth", "can-i", "create", "workloads.kueue.x-k8s.io", "-n", OTHER)
    assert can.stdout.strip() == "no", can.stdout
    # Cluster-wide it reads nodes (placement) and the CRDs (Kopf), and writes no node.
    for allowed in (("get", "nodes"), ("get", "customresourcedefinitions"), ("get", "pods", "-n", WATCHED)):
        read = installed.kubectl_with(as_op, *allowed)
        assert read.returncode == 0, (allowed, read.stderr)
    patched = installed.kubectl_with(as_op, "label", "node", NODE_A, "memstrata.dev/x=1")
    assert patched.returncode != 0 and "forbidden" in patched.stderr.lower()


def test_the_operator_writes_its_own_lease_and_no_other(installed: Installed, tmp_path: Path) -> None:
    cp = installed.cp
    as_op = installed.kubeconfig(installed.token(OPERATOR), tmp_path / "operator")
    cp.kubectl("delete", "lease", LEASE, "-n", RELEASE_NS, "--ignore-not-found")

    def lease(name: str, holder: str) -> dict[str, Any]:
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
                "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15}}

    made = _create(installed, as_op, lease(LEASE, "probe"), RELEASE_NS)
    assert made.returncode == 0, made.stderr
    current = json.loads(installed.kubectl_with(as_op, "get", "lease", LEASE, "-n", RELEASE_NS, "-o", "json").stdout)
    current["spec"]["holderIdentity"] = ""  # let it go: the next test's operator takes it at once
    updated = installed.kubectl_with(as_op, "replace", "-f", "-", input=json.dumps(current))
    assert updated.returncode == 0, updated.stderr

    # Another Lease in the release namespace, written by someone else: neither read nor written.
    cp.apply(lease("kube-something", "someone"), namespace=RELEASE_NS)
    for args in (("get", "lease", "kube-something", "-n", RELEASE_NS),
                 ("delete", "lease", LEASE, "-n", RELEASE_NS), ("get", "leases", "-n", RELEASE_NS)):
        refused = installed.kubectl_with(as_op, *args)
        assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), (args, refused.stderr)
    other = json.loads(cp.kubectl("get", "lease", "kube-something", "-n", RELEASE_NS, "-o", "json"))
    other["spec"]["holderIdentity"] = "operator"
    refused = installed.kubectl_with(as_op, "replace", "-f", "-", input=json.dumps(other))
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr
    # No Lease anywhere else, the watched namespace and the cluster's own kube-node-lease included.
    for ns in (WATCHED, OTHER, "kube-node-lease"):
        refused = _create(installed, as_op, lease(LEASE, "probe"), ns)
        assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), (ns, refused.stderr)


def test_the_operator_runs_a_watched_namespaces_job_under_the_charts_identity(
        installed: Installed, tmp_path: Path) -> None:
    for module in ("kopf", "kubernetes"):
        try:
            __import__(module)
        except ImportError as exc:
            unavailable(f"the operator's dependencies are not installed ({exc}); run `make install`")
    cp = installed.cp
    as_op = installed.kubeconfig(installed.token(OPERATOR), tmp_path / "operator")
    deployment = next(d for d in installed.docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    # The Deployment's own arguments (--namespace per watched namespace, the Lease), less the
    # liveness endpoint's fixed port; its pod's name is the replica's identity.
    args = [a for a in container["args"] if not a.startswith("--liveness")]
    assert container["command"] == ["memstrata"] and args[0] == "operator"
    assert f"--namespace={WATCHED}" in args and f"--namespace={OTHER}" not in args
    assert "--kueue" in args  # kueue.enabled=auto on a cluster serving Kueue's API: its Workloads are watched too

    log = tmp_path / "operator.log"
    env = {**os.environ, "POD_NAME": "memstrata-operator-rbac", "PYTHONPATH": os.pathsep.join(
        [str(REPO / "operator"), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "memstrata.cli", "operator", "--kubeconfig", str(as_op),
                                 *args[1:]], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=REPO, start_new_session=True)
    try:
        watched = job("owned")
        watched["metadata"]["namespace"] = WATCHED
        elsewhere = job("elsewhere")
        elsewhere["metadata"]["namespace"] = OTHER
        cp.apply(watched, elsewhere)

        def tail() -> str:
            return log.read_text(errors="replace")[-6000:]

        def running() -> bool:
            assert proc.poll() is None, f"the operator exited with {proc.returncode}:\n{tail()}"
            status = cp.get_json("finetunejob", "owned", "-n", WATCHED).get("status") or {}
            return status.get("phase") == "Running"

        try:
            cp.wait_for("the watched namespace's job Running", running, timeout=90)
        except ControlPlaneError as exc:
            raise AssertionError(f"{exc}\n{tail()}") from None
        from memstrata.operator import names

        account = names.runtime_account_name(
            "owned", cp.get_json("finetunejob", "owned", "-n", WATCHED)["metadata"]["uid"])

        def made() -> bool:
            return all(cp.find_json(kind, account, "-n", WATCHED) is not None
                       for kind in ("serviceaccount", "role", "rolebinding"))

        try:
            cp.wait_for(f"the job's ServiceAccount, Role and RoleBinding {WATCHED}/{account}", made, timeout=15)
        except ControlPlaneError as exc:
            raise AssertionError(f"{exc}\n{tail()}") from None
        # The runtime's identity it made works: the job's token may report progress.
        runtime = installed.kubeconfig(
            cp.kubectl("create", "token", account, "-n", WATCHED, "--duration=10m").strip(), tmp_path / "runtime")
        reported = installed.kubectl_with(runtime, "patch", "finetunejob", "owned", "-n", WATCHED,
                                          "--subresource=status", "--type=merge",
                                          "-p", json.dumps({"status": {"progress": {"step": 1, "total": 10}}}))
        assert reported.returncode == 0, f"{reported.stderr}\n{tail()}"

        time.sleep(3)  # the other namespace's job stays untouched: no status, no finalizer, no pod
        other = cp.get_json("finetunejob", "elsewhere", "-n", OTHER)
        assert not other.get("status") and not other["metadata"].get("finalizers"), other
        assert not cp.get_json("pods", "-n", OTHER)["items"]
        text = log.read_text(errors="replace")
        assert "forbidden" not in text.lower(), tail()
        lease = cp.get_json("lease", LEASE, "-n", RELEASE_NS)
        assert lease["spec"]["holderIdentity"].startswith("memstrata-operator-rbac"), lease["spec"]
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        print(f"\n[operator] log: {log}")
