"""Two pods of a `nodes: 2` job, each a real `memstrata pod`, train together and report into the real API server.

The operator's objects for the attempt (ServiceAccount, Role, RoleBinding, runtime config, headless Service and
both pods' env) are rendered and applied as the operator would; kwok nodes run no containers, so each pod's
process runs here, with the pod's own env (only MASTER_ADDR/PORT point at this machine: the Service's DNS name
does not resolve outside a cluster) and a token of the job's ServiceAccount. Both pods must end with their own
status.workers entry (one pod's patches never overwrite the other's), and the job's progress must be the one
the job's rank 0 reported: the last step, a loss averaged over both ranks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from memstrata.api.finetunejob import FineTuneJob
from memstrata.node.local import local_inventory
from memstrata.operator import names
from memstrata.operator.observe import job_view
from memstrata.operator.render import gang_objects
from memstrata.plan import plan_job

from e2e.cluster.procs import free_port
from e2e.operator.harness import token_kubeconfig

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "finetune-tiny.yaml"
STEPS = 6


def test_two_real_pods_report_without_overwriting_each_other(memstrata_cluster: Any, namespace: str,
                                                             tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: run `make install`")
    cluster = memstrata_cluster
    doc = yaml.safe_load(TINY.read_text())
    doc["metadata"] = {"name": "pair-pods", "namespace": namespace}
    doc["spec"]["training"].update(steps=STEPS, precision="fp32")
    doc["spec"]["resources"] = {"gpus": 0, "nodes": 2}
    # Stock DeepSpeed with everything in DRAM: what is under test is the pods' reports, not the offload.
    doc["spec"]["memory"] = {"engine": "deepspeed", "nvmeNamespaces": 0}
    cluster.apply(doc)
    body = cluster.get_json("finetunejob", "pair-pods", "-n", namespace)
    job = FineTuneJob.model_validate(doc)
    plan = plan_job(job.spec, local_inventory(tmp_path / "nvme"))
    assert plan.feasible, plan
    companions, pods = gang_objects(job_view(body), ["node-a", "node-b"], plan, attempt=0,
                                    report_interval_seconds=1)
    cluster.apply(*[o for o in companions if o["kind"] != "ConfigMap"], namespace=namespace)
    config = tmp_path / "runtime-config.json"
    config.write_text(next(o for o in companions if o["kind"] == "ConfigMap")["data"]["runtime-config.json"])
    cluster.kubectl("patch", "finetunejob", "pair-pods", "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"phase": "Created", "activePod": pods[0]["metadata"]["name"]}}))
    account = names.runtime_account_name("pair-pods", body["metadata"]["uid"])
    kubeconfig = token_kubeconfig(cluster, namespace, account, tmp_path / "runtime.kubeconfig")

    port = free_port()
    procs = []
    for rank, pod in enumerate(pods):
        env = {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}
        assert env["PET_NODE_RANK"] == str(rank) and env["PET_NNODES"] == "2"
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), POD_NAME=pod["metadata"]["name"],
                   MEMSTRATA_NODE_NAME=["node-a", "node-b"][rank], MEMSTRATA_RUNTIME_CONFIG=str(config))
        work = tmp_path / f"pod{rank}"
        work.mkdir()
        full = {**os.environ, **env, "KUBECONFIG": str(kubeconfig), "MEMSTRATA_SCRATCH": str(work / "scratch"),
                "DS_ACCELERATOR": "cpu"}
        procs.append(subprocess.Popen([sys.executable, "-m", "memstrata.cli", "pod"], env=full, cwd=work,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(1)
    outs = []
    for p in procs:
        if p.poll() is None:
            p.kill()
        outs.append(p.communicate()[0])
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]

    status = cluster.get_json("finetunejob", "pair-pods", "-n", namespace)["status"]
    workers = status["workers"]
    assert set(workers) == {"0", "1"}, workers
    for rank in ("0", "1"):
        w = workers[rank]
        assert w["pod"] == pods[int(rank)]["metadata"]["name"] and w["node"] == ["node-a", "node-b"][int(rank)]
        assert (w["step"], w["stage"], w["ranks"]) == (STEPS, "finished", 1), w
        assert w["peakMemory"]["dram"] > 50 << 20, w
    progress = status["progress"]
    assert (progress["step"], progress["total"]) == (STEPS, STEPS)
    assert isinstance(progress["loss"], float) and progress["loss"] > 0
