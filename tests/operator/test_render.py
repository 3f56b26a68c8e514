"""The objects of one attempt: what the API server, the scheduler, PodSecurity and the runtime will see."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from ftj_factories import REPO, inventory, job_dict, node_dict

from memstrata.api.inventory import NodeInventory, NumaNode, NvmeNamespace
from memstrata.api.runtimeconfig import CONFIGMAP_KEY, RuntimeConfig
from memstrata.api.strataplan import Allocation, CategoryPlan, Plan
from memstrata.nodeagent.devices import resources
from memstrata.operator import names
from memstrata.operator.nodes import node_view, pod_requests
from memstrata.operator.observe import job_view
from memstrata.operator.scheduling import place
from memstrata.operator.render import gang_objects, memory_bytes

JOB = job_view(job_dict("llama", labels={"user.memstrata.dev/team": "nlp"}))
CXL_NODE = node_view(node_dict("cxl-1", inventory("cxl-1", dram_gib=512, cxl_gib=256)))
PLACED = place(JOB.spec, [CXL_NODE], {})


def objects(attempt: int = 2):
    assert PLACED.plan is not None
    companions, (pod,) = gang_objects(JOB, ("cxl-1",), PLACED.plan, attempt, report_interval_seconds=5)
    return companions, pod


def test_pod_requests_exactly_what_the_plan_asks_and_is_pinned_to_the_node():
    _, pod = objects()
    assert PLACED.plan.requests == {"nvidia.com/gpu": 1, "memstrata.dev/cxl-gib": 23}
    assert pod_requests(pod["spec"]) == {"nvidia.com/gpu": 1, "memstrata.dev/nvme-ns": 0, "memstrata.dev/cxl-gib": 23,
                                         "memory": memory_bytes(PLACED.plan, 1)}
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
    assert pod["metadata"]["labels"]["user.memstrata.dev/team"] == "nlp"


def test_configmap_carries_a_runtime_config_the_runtime_can_read():
    before, pod = objects()
    cm = next(o for o in before if o["kind"] == "ConfigMap")
    config = RuntimeConfig.model_validate(json.loads(cm["data"][CONFIGMAP_KEY]))
    assert config.job.name == "llama" and config.job.uid == "uid-1" and config.node == "cxl-1"
    assert config.attempt == 2 and config.report_interval_seconds == 5
    assert config.plan == PLACED.plan
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["MEMSTRATA_RUNTIME_CONFIG"] == f"/etc/memstrata/{CONFIGMAP_KEY}"
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == names.CONFIG_VOLUME]
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    assert config.spec.output == JOB.spec.output and config.spec.output.path == "/output/llama3-8b-32k-chat"


def test_every_attempts_runtime_config_carries_the_checkpoint_spec():
    """A retry resumes from spec.checkpoint: the runtime looks there itself, so each attempt's config must say
    where, exactly as the job does; a job without checkpoints gets none."""
    body = job_dict("llama")
    body["spec"]["checkpoint"] = {"path": "/output/ckpt", "everySteps": 50, "keep": 3}
    job = job_view(body)
    assert PLACED.plan is not None
    for attempt in (0, 3):
        before, _ = gang_objects(job, ("cxl-1",), PLACED.plan, attempt)
        cm = next(o for o in before if o["kind"] == "ConfigMap")
        config = RuntimeConfig.model_validate(json.loads(cm["data"][CONFIGMAP_KEY]))
        assert config.spec.checkpoint == job.spec.checkpoint and config.attempt == attempt
        assert json.loads(cm["data"][CONFIGMAP_KEY])["spec"]["checkpoint"] == {"path": "/output/ckpt", "everySteps": 50,
                                                                      "keep": 3, "exportModel": False}
    # The newest checkpoint the status reports goes along: the runtime must find at least that far.
    body["status"] = {"checkpoint": {"path": "/output/ckpt/step-00000150", "step": 150,
                                     "time": "2026-11-23T10:00:00Z"}}
    before, _ = gang_objects(job_view(body), ("cxl-1",), PLACED.plan, 4)
    cm = next(o for o in before if o["kind"] == "ConfigMap")
    assert json.loads(cm["data"][CONFIGMAP_KEY])["checkpointStep"] == 150
    del body["spec"]["checkpoint"]
    before, _ = gang_objects(job_view(body), ("cxl-1",), PLACED.plan, 0)
    cm = next(o for o in before if o["kind"] == "ConfigMap")
    assert "checkpoint" not in json.loads(cm["data"][CONFIGMAP_KEY])["spec"]
    assert "checkpointStep" not in json.loads(cm["data"][CONFIGMAP_KEY])


def test_the_jobs_volumes_are_mounted_first_beside_the_operators_own():
    _, pod = objects()
    volumes, mounts = pod["spec"]["volumes"], pod["spec"]["containers"][0]["volumeMounts"]
    # The job's own, in its order and as written, then the runtime config: the API server's
    # `spec.volumes[i]` in an error about the pod is the job's `spec.volumes[i]`.
    assert volumes[:3] == [
        {"name": "models", "persistentVolumeClaim": {"claimName": "llama3-8b-weights", "readOnly": True}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "chat-data", "readOnly": True}},
        {"name": "output", "persistentVolumeClaim": {"claimName": "finetune-output"}}]
    assert [v["name"] for v in volumes[3:]] == [names.CONFIG_VOLUME]
    assert [(m["name"], m["mountPath"], m["readOnly"]) for m in mounts] == [
        ("models", "/models", True), ("data", "/data", True), ("output", "/output", False),
        (names.CONFIG_VOLUME, names.CONFIG_MOUNT, True)]


def test_a_volume_source_is_passed_as_written():
    body = job_dict("nfs")
    body["spec"]["volumes"][0] = {"name": "models", "nfs": {"server": "10.0.0.5", "path": "/export/models",
                                                             "readOnly": True}}
    job = job_view(body)
    _, (pod,) = gang_objects(job, ("cxl-1",), PLACED.plan, 0)
    assert pod["spec"]["volumes"][0] == body["spec"]["volumes"][0]


def test_the_runtime_config_carries_the_shape_read_from_the_model_directory():
    body = job_dict("inspected")
    del body["spec"]["model"]["architecture"]
    job = job_view(body)
    learned = JOB.spec.model.architecture
    before, _ = gang_objects(job, ("cxl-1",), PLACED.plan, 0, architecture=learned)
    cm = next(o for o in before if o["kind"] == "ConfigMap")
    config = RuntimeConfig.model_validate(json.loads(cm["data"][CONFIGMAP_KEY]))
    assert config.spec.model.path == "/models/Meta-Llama-3-8B-Instruct" and config.spec.model.architecture == learned


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
    _, (pod,) = gang_objects(long, ("cxl-1",), PLACED.plan, 7)
    assert len(pod["metadata"]["name"]) <= 253 and pod["metadata"]["name"].endswith("-7")
    assert all(len(v) <= 63 for v in pod["metadata"]["labels"].values())


def test_command_overrides_the_entrypoint():
    job = job_dict()
    job["spec"]["command"] = ["python", "-m", "my.trainer"]
    _, (pod,) = gang_objects(job_view(job), ("cxl-1",), PLACED.plan, 0)
    assert pod["spec"]["containers"][0]["command"] == ["python", "-m", "my.trainer"]


GiB, MiB = 1 << 30, 1 << 20


def _cat(name: str, *placed: tuple[str, int]) -> CategoryPlan:
    return CategoryPlan(category=name, description=name, bytes=sum(b for _, b in placed),
                        placement=[Allocation(stratum=s, bytes=b) for s, b in placed])


def test_memory_request_and_limit_are_the_plans_host_memory_plus_the_process_overhead():
    """A CPU job: working set 3 GiB + pinned 512 MiB + gradients 1 GiB + 2 GiB of the fp32 master weights
    = 6.5 GiB of DRAM (the other 2 GiB of master and the moments are on NVMe), + 1 GiB of weights on
    CXL (the memory cgroup charges CXL pages too), + 2 GiB for the one rank process = 9.5 GiB = 9728 MiB."""
    plan = Plan(parameters=1, engine="memstrata", feasible=True, strata=[], categories=[
        _cat("working", ("dram", 3 * GiB)), _cat("pinned", ("dram", 512 * MiB)), _cat("gradients", ("dram", GiB)),
        _cat("master", ("dram", 2 * GiB), ("nvme", 2 * GiB)), _cat("optimizer", ("nvme", 8 * GiB)),
        _cat("weights", ("cxl", GiB))], requests={"memstrata.dev/nvme-ns": 1})
    cpu = job_dict()
    cpu["spec"]["resources"]["gpus"] = 0
    _, (pod,) = gang_objects(job_view(cpu), ("cxl-1",), plan, 0)
    res = pod["spec"]["containers"][0]["resources"]
    assert res["requests"] == res["limits"] == {"memory": "9728Mi", "memstrata.dev/nvme-ns": "1"}
    two_gpus = job_dict()
    two_gpus["spec"]["resources"]["gpus"] = 2
    _, (pod,) = gang_objects(job_view(two_gpus), ("cxl-1",), plan, 0)
    # One rank process per GPU: 7.5 GiB + 2 x 2 GiB = 11.5 GiB.
    assert pod["spec"]["containers"][0]["resources"]["limits"]["memory"] == "11776Mi"


def test_a_tighter_dram_budget_lowers_the_pods_memory_limit():
    spec_file = "examples/finetune-tiny.yaml"
    node = node_view(node_dict("n", NodeInventory(
        numa_nodes=[NumaNode(id=0, cpus=[0, 1], memory_bytes=64 * GiB)],
        nvme_namespaces=[NvmeNamespace(name="nvme0n1", size_bytes=1 << 40, free=True)])))
    limits = {}
    # A model whose offloadable state outweighs its CPU working set: the tiny example's state (8 MB) is smaller
    # than its activations now that the plan counts them, so no budget moves its limit by a whole MiB.
    for budget in ("1Gi", "4Gi"):
        job = job_dict(spec_file=spec_file)
        job["spec"]["model"] = {"preset": "gpt-125m"}
        job["spec"]["memory"]["dramBudget"] = budget
        placed = place(job_view(job).spec, [node], {})
        assert placed.plan is not None and placed.plan.feasible
        _, (pod,) = gang_objects(job_view(job), ("n",), placed.plan, 0)
        limits[budget] = int(pod["spec"]["containers"][0]["resources"]["limits"]["memory"].removesuffix("Mi"))
        assert limits[budget] * MiB >= placed.plan.bytes_on("dram") + 2 * GiB
    assert limits["1Gi"] + 512 < limits["4Gi"]


# --- every environment variable set for a container is read by some module -------------------------------------

SOURCES = [REPO / "operator" / "memstrata", REPO / "runtime" / "memstrata"]
CHART = REPO / "charts" / "memstrata" / "templates"


def _str_constants(trees: list[ast.Module]) -> dict[str, str]:
    """Module-level NAME = "literal" assignments, by name (ENV_NVME_DEVICES -> MEMSTRATA_NVME_DEVICES)."""
    out: dict[str, str] = {}
    for tree in trees:
        for node in tree.body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = node.value.value
    return out


def names_read_from_the_environment() -> set[str]:
    """Names some module reads: os.environ.get / os.environ[...] / os.getenv, an `env` mapping's get or
    item, or a helper handed the environment together with the name (`_env_list(env, ENV_CXL_NODES)`).
    The name may be a literal or a module constant holding it."""
    trees = [ast.parse(f.read_text()) for root in SOURCES for f in root.rglob("*.py") if "_pb2" not in f.name]
    consts = _str_constants(trees)

    def value(node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        return consts.get(name) if name else None

    def is_env(node: ast.expr) -> bool:
        text = ast.unparse(node)
        return text.endswith("environ") or text == "env"

    read: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and is_env(node.value):
                read.add(value(node.slice) or "")
            elif isinstance(node, ast.Call):
                func = node.func
                env_method = isinstance(func, ast.Attribute) and (is_env(func.value)
                                                                  or ast.unparse(func) == "os.getenv")
                if env_method or any(is_env(a) for a in node.args):
                    read.update(v for a in node.args if (v := value(a)))
    return read - {""}


def _set_in_chart() -> set[str]:
    # Upper-case names in the templates are environment variables: Kubernetes object names are lower case.
    return {m for f in CHART.glob("*.yaml") for m in re.findall(r"(?:-\s+name:|\{name:)\s*([A-Z][A-Z0-9_]*)\b",
                                                                   f.read_text())}


def test_every_env_var_the_pod_the_device_plugin_or_the_chart_sets_is_read():
    _, pod = objects()
    set_by = {f"pod {pod['metadata']['name']}": {e["name"] for c in pod["spec"]["containers"] for e in c["env"]}}
    inv = inventory("n", dram_gib=64, cxl_gib=4)
    for resource in resources():
        devices = resource.devices(inv)
        set_by[f"device plugin {resource.name}"] = set(resource.grant([devices[0]]).envs)
    set_by["chart"] = _set_in_chart()
    read = names_read_from_the_environment()
    # The scanner itself finds the readers it must (so an empty result cannot pass for "all read").
    assert {"MEMSTRATA_RUNTIME_CONFIG", "MEMSTRATA_NVME_DEVICES", "MEMSTRATA_CXL_NODES", "NODE_NAME"} <= read
    assert set_by["chart"] >= {"NODE_NAME", "PYTHONUNBUFFERED"}
    for who, env in set_by.items():
        # PYTHON* are read by the interpreter itself.
        unread = sorted(n for n in env if n not in read and not n.startswith("PYTHON"))
        assert not unread, f"{who} sets {unread}, which no module of operator/ or runtime/ reads"
