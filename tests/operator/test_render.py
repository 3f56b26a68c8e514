"""The objects of one attempt: what the API server, the scheduler, PodSecurity and the runtime will see."""
from __future__ import annotations

import json

from ftj_factories import inventory, job_dict, node_dict

from memstrata.api.runtimeconfig import CONFIGMAP_KEY, RuntimeConfig
from memstrata.operator import names
from memstrata.operator.nodes import node_view, pod_requests
from memstrata.operator.observe import job_view
from memstrata.operator.scheduling import place
from memstrata.operator.render import attempt_objects

JOB = job_view(job_dict("llama", labels={"team": "nlp"}))
CXL_NODE = node_view(node_dict("cxl-1", inventory("cxl-1", dram_gib=512, cxl_gib=256)))
PLACED = place(JOB.spec, [CXL_NODE], {})


def objects(attempt: int = 2):
    assert PLACED.plan is not None
    return attempt_objects(JOB, "cxl-1", PLACED.plan, attempt, report_interval_seconds=5)


def test_pod_requests_exactly_what_the_plan_asks_and_is_pinned_to_the_node():
    _, pod = objects()
    assert PLACED.plan.requests == {"nvidia.com/gpu": 1, "memstrata.dev/cxl-gib": 23}
    assert pod_requests(pod["spec"]) == {"nvidia.com/gpu": 1, "memstrata.dev/nvme-ns": 0, "memstrata.dev/cxl-gib": 23}
    res = pod["spec"]["containers"][0]["resources"]
    assert res["requests"] == res["limits"]  # extended resources cannot be overcommitted
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    exprs = {e["key"]: e["values"] for e in terms["nodeSelectorTerms"][0]["matchExpressions"]}
    assert exprs == {"kubernetes.io/hostname": ["cxl-1"], "memstrata.dev/managed": ["true"], "memstrata.dev/cxl": ["true"]}


def test_pod_meets_pod_security_restricted():
    _, pod = objects()
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert "privileged" not in sc
    assert not any(k in spec for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert all("hostPath" not in v for v in spec["volumes"])


def test_every_object_is_owned_by_the_job_and_labelled_with_its_uid():
    before, pod = objects()
    for obj in before + [pod]:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "memstrata.dev/v1alpha1", "kind": "FineTuneJob", "name": "llama",
                       "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}
        assert obj["metadata"]["labels"][names.LABEL_JOB_UID] == "uid-1"
        assert obj["metadata"]["namespace"] == "team-a"
    assert pod["metadata"]["name"] == "llama-2" and pod["metadata"]["labels"][names.LABEL_ATTEMPT] == "2"
    assert pod["metadata"]["labels"]["team"] == "nlp"


def test_configmap_carries_a_runtime_config_the_runtime_can_read():
    before, pod = objects()
    cm = next(o for o in before if o["kind"] == "ConfigMap")
    config = RuntimeConfig.model_validate(json.loads(cm["data"][CONFIGMAP_KEY]))
    assert config.job.name == "llama" and config.job.uid == "uid-1" and config.node == "cxl-1"
    assert config.attempt == 2 and config.report_interval_seconds == 5
    assert config.plan == PLACED.plan
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["MEMSTRATA_RUNTIME_CONFIG"] == f"/etc/memstrata/{CONFIGMAP_KEY}"
    assert pod["spec"]["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]


def test_runtime_role_may_only_touch_its_own_job():
    before, pod = objects()
    role = next(o for o in before if o["kind"] == "Role")
    binding = next(o for o in before if o["kind"] == "RoleBinding")
    sa = next(o for o in before if o["kind"] == "ServiceAccount")
    for rule in role["rules"]:
        assert rule["resourceNames"] == ["llama"] and set(rule["verbs"]) <= {"get", "patch"}
        assert rule["apiGroups"] == ["memstrata.dev"]
    assert {r["resources"][0]: r["verbs"] for r in role["rules"]} == {
        "finetunejobs/status": ["get", "patch"], "finetunejobs": ["get"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "team-a"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert pod["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    # ServiceAccount before the pod, or admission rejects the pod.
    assert [o["kind"] for o in before] == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap"]


def test_long_job_names_still_give_valid_names_and_labels():
    long = job_view(job_dict("x" * 253))
    _, pod = attempt_objects(long, "cxl-1", PLACED.plan, 7)
    assert len(pod["metadata"]["name"]) <= 253 and pod["metadata"]["name"].endswith("-7")
    assert all(len(v) <= 63 for v in pod["metadata"]["labels"].values())


def test_command_overrides_the_entrypoint():
    job = job_dict()
    job["spec"]["command"] = ["python", "-m", "my.trainer"]
    _, pod = attempt_objects(job_view(job), "cxl-1", PLACED.plan, 0)
    assert pod["spec"]["containers"][0]["command"] == ["python", "-m", "my.trainer"]
