"""RuntimeConfig: the only thing that crosses from the operator to the job's pod.

The operator renders it into a ConfigMap (key `runtime-config.json`); the runtime
reads it at start. It carries the job's spec whole (a field added to FineTuneJobSpec
reaches the pod with no change here) and the typed plan for the chosen node.

`version` is checked so a runtime image refuses a config of another version with a
clear message instead of misreading it. The operator and the runtime image come from one
chart release, so a runtime reads its own version only: v1 (the spec split into seven
fields) is refused, naming the version (`load_config`, memstrata.runtime.train.pod).
"""
from __future__ import annotations

from typing import Final, Literal

from pydantic import Field

from memstrata.api.base import ApiModel
from memstrata.api.finetunejob import FineTuneJob, FineTuneJobSpec, Metadata
from memstrata.api.strataplan import Plan

RUNTIME_CONFIG_VERSION: Final = "memstrata.dev/runtime-config/v2"
# Versions an earlier operator wrote, which this runtime refuses by name (the chart upgrades both together).
RETIRED_CONFIG_VERSIONS: Final = ("memstrata.dev/runtime-config/v1",)
CONFIGMAP_KEY = "runtime-config.json"
ENV_RUNTIME_CONFIG = "MEMSTRATA_RUNTIME_CONFIG"
# The pod's place in a multi-node job, set by the operator on each pod (the names Kubeflow's PyTorchJob and
# torchrun use): rank 0's stable DNS name through the job's headless Service and the rendezvous port, this
# pod's node rank and the job's node count. One ConfigMap serves every pod; only these differ between them.
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"
ENV_NODE_RANK = "PET_NODE_RANK"
ENV_NNODES = "PET_NNODES"
RENDEZVOUS_PORT = 29400
# Where the pod itself landed (the downward API), for its status.workers entry: the runtime config names node
# rank 0's node only.
ENV_POD_NAME = "POD_NAME"
ENV_NODE_NAME = "MEMSTRATA_NODE_NAME"


class JobRef(ApiModel):
    """Which FineTuneJob the runtime reports progress into."""

    name: str
    namespace: str = "default"
    uid: str = ""


class RuntimeConfig(ApiModel):
    version: Literal["memstrata.dev/runtime-config/v2"] = RUNTIME_CONFIG_VERSION
    job: JobRef
    spec: FineTuneJobSpec = Field(description="The job's spec, whole; with model.path, model.architecture is "
                                              "always filled in (as the job states it, or as the operator read "
                                              "it from config.json).")
    checkpoint_step: int | None = Field(
        None, ge=1, description="status.checkpoint.step when this attempt was created: finding no checkpoint that "
                                "far (and none damaged) means the path lost them, and the runtime fails rather than "
                                "start over.")
    plan: Plan = Field(description="The plan for the chosen node: what the runtime sizes its strata from.")
    node: str = ""
    attempt: int = Field(0, ge=0, description="Which pod attempt this is (0-based).")
    report_interval_seconds: float = Field(10.0, gt=0, description="How often the runtime patches job status.")

    def finetune_job(self) -> FineTuneJob:
        """The FineTuneJob a run takes: this config's job, with its spec as the operator passed it."""
        return FineTuneJob(metadata=Metadata(name=self.job.name, namespace=self.job.namespace), spec=self.spec)
