"""The FineTuneJob CustomResourceDefinition, generated from the pydantic models.

Pure: models in, a dict out. `memstrata crd` prints it; crds/finetunejob.yaml is
its committed output and a test fails when the two differ, so the API server and
the CLI validate against one source.
"""
from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import JsonDict

from memstrata.api.architecture import PRESETS
from memstrata.api.base import cel
from memstrata.api.families import FAMILIES
from memstrata.api.finetunejob import (ADDED_TOKENS_LORA_RULE, GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION,
                                      FineTuneJobSpec)
from memstrata.api.jobstatus import FineTuneJobStatus
from memstrata.api.layermajor import LAYER_MAJOR_RULE
from memstrata.api.updatemode import DELAYED_UPDATE_RULE
from memstrata.api.selection import EPOCHS_RULE, SELECTION_RULE

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Node", "type": "string", "jsonPath": ".status.node"},
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress.summary"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss", "priority": 1},
    {"name": "ETA", "type": "string", "jsonPath": ".status.progress.eta"},
    # The step a retry (or a resumed job) would start from: what a failure now would cost.
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.checkpoint.step"},
    # A path is too long for the default table: `kubectl get ftj -o wide` shows where the model went.
    {"name": "Output", "type": "string", "jsonPath": ".status.output.path", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

# Fields a running job may not change: a new model or dataset is a new job. The volumes too: the shape the
# operator read from the model directory, and the output a retry resumes writing, are the volumes' as created.
# And the checkpoints: a retry resumes from spec.checkpoint.path, so a path changed mid-job (or checkpoints
# removed) would silently start training over.
IMMUTABLE = ("model", "dataset", "training", "resources", "memory", "output", "checkpoint", "volumes",
             "volumeMounts")


def _unchanged(field: str) -> str:
    """CEL for "spec.<field> did not change". An optional field may be absent on either side, and
    `self.f` on an absent key is an error that fails every update of the object (finalizers, labels,
    status): absent on both sides is unchanged, absent on one is a change. (Optional selection,
    `self.?f == oldSelf.?f`, says the same but its estimated cost is over the API server's budget.)"""
    if field in FineTuneJobSpec.model_fields and FineTuneJobSpec.model_fields[field].is_required():
        return f"self.{field} == oldSelf.{field}"
    return f"(has(self.{field}) ? has(oldSelf.{field}) && self.{field} == oldSelf.{field} : !has(oldSelf.{field}))"


def spec_rules() -> list[JsonDict]:
    """Cross-field rules on the whole spec, mirrored by FineTuneJobSpec's validators."""
    rules = [
        cel(" && ".join(_unchanged(f) for f in IMMUTABLE),
            "only spec.runPolicy, spec.image and spec.command may change after creation; "
            "spec." + ", spec.".join(IMMUTABLE) + " are immutable"),
        cel("!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
            "self.volumes.exists(v, v.name == m.name))",
            "every volumeMounts[].name must be one of spec.volumes[].name", ".volumeMounts"),
        *[cel(f"!has(self.model.architecture) || self.model.architecture.family != '{f.name}' || "
              "self.training.sequenceLength <= self.model.architecture.maxPositions",
              f"training.sequenceLength must not exceed model.architecture.maxPositions for a {f.name} model",
              ".training.sequenceLength") for f in FAMILIES.values() if f.learned_positions],
        cel("!has(self.checkpoint) || !has(self.output) || !(self.checkpoint.path == self.output.path || "
            "self.checkpoint.path.startsWith(self.output.path + '/'))",
            "checkpoint.path must not be output.path or inside it: the model directory is created whole at the end",
            ".checkpoint.path"),
        SELECTION_RULE, EPOCHS_RULE, ADDED_TOKENS_LORA_RULE, LAYER_MAJOR_RULE, DELAYED_UPDATE_RULE,
    ]
    for name, arch in PRESETS.items():
        if arch.spec.learned_positions:
            rules.append(cel(
                f"!has(self.model.preset) || self.model.preset != '{name}' || "
                f"self.training.sequenceLength <= {arch.max_positions}",
                f"training.sequenceLength must be at most {arch.max_positions} for preset {name}",
                ".training.sequenceLength"))
    return rules


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline $refs and rewrite JSON Schema 2020-12 into the OpenAPI v3 subset the API server takes."""
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _resolve({**target, **extra}, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o != {"type": "null"}]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(options) == 1:
            return _resolve({**options[0], **rest}, defs)
        node = {**rest, "anyOf": options}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "$defs"):
            continue
        if key == "default":
            if value is None or isinstance(value, (dict, list)):
                continue  # object defaults are the models' business, not the API server's
        if key == "const":
            out["enum"] = [value]
            continue
        if key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
            continue
        if key == "properties":
            out[key] = {k: _resolve(v, defs) for k, v in value.items()}
            continue
        out[key] = _resolve(value, defs)
    default = out.get("default")
    if (out.get("type") == "number" and isinstance(default, float) and default.is_integer()
            and (out.get("exclusiveMaximum") or out.get("exclusiveMinimum"))):
        # The API server checks a default of 0.0 as the integer 0, against the bound cast to an integer
        # too (0.5 -> 0), and refuses the CRD ("default: 0 should be less than 0"); the models default it.
        del out["default"]
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("additionalProperties") is False:
        del out["additionalProperties"]  # structural schemas prune unknown fields anyway
    if out.get("additionalProperties") is True:
        del out["additionalProperties"]
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True)
    out: dict[str, Any] = _resolve(raw, raw.get("$defs", {}))
    return out


def generate_crd() -> dict[str, Any]:
    spec = openapi_schema(FineTuneJobSpec)
    spec["x-kubernetes-validations"] = spec_rules()
    # Every field anyone writes is declared (FineTuneJobStatus): the API server prunes any other, and refuses a
    # declared one of the wrong type, so what the operator reads back is what its models say.
    status = openapi_schema(FineTuneJobStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": SHORT_NAMES,
                      "categories": ["all", "memstrata"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A fine-tuning job whose memory is spread over HBM, DRAM, CXL and NVMe.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec,
                        "status": status,
                    },
                }},
            }],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `memstrata crd` from memstrata.api — do not edit by hand.\n"
    return header + yaml.safe_dump(generate_crd(), sort_keys=False, width=120)
