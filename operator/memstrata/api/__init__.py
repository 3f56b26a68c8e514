"""memstrata's contracts: FineTuneJob, the node inventory and its Kubernetes form,
the runtime config handed to pods and the report they send back."""
from memstrata.api.architecture import PRESETS, ModelArchitecture
from memstrata.api.finetunejob import API_VERSION, GROUP, KIND, PLURAL, VERSION, FineTuneJob, FineTuneJobSpec
from memstrata.api.jobstatus import Condition, FineTuneJobStatus, Progress
from memstrata.api.manifest import ManifestError, load_job, load_node
from memstrata.api.inventory import (
    NodeInventory, NodeNotManagedError, read_node, render_node,
)
from memstrata.api.report import RuntimeReport, StratumCounters
from memstrata.api.runtimeconfig import RuntimeConfig
from memstrata.api.strataplan import Plan

__all__ = [
    "API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "PRESETS", "Condition", "FineTuneJob", "FineTuneJobSpec",
    "FineTuneJobStatus", "ManifestError", "ModelArchitecture", "NodeInventory", "NodeNotManagedError", "Plan", "Progress",
    "RuntimeConfig", "RuntimeReport", "StratumCounters", "load_job", "load_node", "read_node", "render_node",
]
