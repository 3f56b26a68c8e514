"""The committed CRD is exactly what the models generate, and carries what kubectl users rely on."""
from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from memstrata.api.crd import crd_yaml, generate_crd
from memstrata.api.jobstatus import FineTuneJobStatus
from memstrata.api.strataplan import Plan


CRD = "charts/memstrata/crds/finetunejob.yaml"  # what Helm installs; crds/finetunejob.yaml links to it


def test_committed_crd_matches_models(repo) -> None:
    """One CRD is committed, the chart's; crds/ holds a link to it, not a second copy."""
    committed = (repo / CRD).read_text()
    assert committed == crd_yaml(), f"{CRD} is stale: run `make crd`"
    assert (repo / "crds/finetunejob.yaml").is_symlink() and (repo / "crds/finetunejob.yaml").resolve() == repo / CRD


def test_cli_prints_the_same_crd(cli, repo) -> None:
    out = cli("crd")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (repo / CRD).read_text()


def test_crd_names_status_and_columns() -> None:
    crd = generate_crd()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "finetunejobs.memstrata.dev"
    assert spec["names"]["shortNames"] == ["ftj"] and spec["names"]["kind"] == "FineTuneJob"
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")] == [
        "Phase", "Node", "Progress", "ETA", "Checkpoint", "Age"]
    checkpoint = next(c for c in version["additionalPrinterColumns"] if c["name"] == "Checkpoint")
    assert (checkpoint["jsonPath"], checkpoint["type"]) == (".status.checkpoint.step", "integer")
    wide = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"] if c.get("priority")}
    assert wide == {"Loss": ".status.progress.loss", "Output": ".status.output.path"}


def _walk(node, path=()):
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from _walk(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, path + (i,))


def test_schema_is_structural_openapi() -> None:
    """No JSON-Schema-only keywords the API server rejects ($ref, const, title, numeric exclusive bounds)."""
    crd = generate_crd()
    for path, node in _walk(crd):
        assert "$ref" not in node and "const" not in node and "$defs" not in node, path
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(key, True) is True, (path, key)


def test_cel_rules_cover_cross_field_constraints() -> None:
    spec = generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    model_rules = [r["rule"] for r in spec["properties"]["model"]["x-kubernetes-validations"]]
    assert "has(self.preset) != has(self.path)" in model_rules
    spec_rules = [r["message"] for r in spec["x-kubernetes-validations"]]
    assert any("immutable" in m for m in spec_rules)
    assert any("at most 512 for preset gpt-tiny" in m for m in spec_rules)
    for rule in ("training.keepBest and training.earlyStopping compare validation losses",
                 "training.epochs: a synthetic dataset is endless", "model.addedTokens with training.method lora"):
        assert any(m.startswith(rule) for m in spec_rules), rule
    training = spec["properties"]["training"]
    assert "(has(self.steps) && self.steps > 0) != has(self.epochs)" in [
        r["rule"] for r in training["x-kubernetes-validations"]]
    training = training["properties"]
    assert training["steps"]["minimum"] == 0 and training["epochs"]["exclusiveMinimum"] is True
    assert training["precision"]["enum"] == ["bf16", "fp16", "fp32"]


def test_status_declares_every_field_typed_and_keeps_no_other() -> None:
    """Nothing under status is kept unread: the API server prunes a field the schema does not declare and refuses
    a declared one of the wrong type, and the model refuses both (status.plan too: the planner's Plan, by field)."""
    status = generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    kept = [".".join(map(str, p)) for p, node in _walk(status) if "x-kubernetes-preserve-unknown-fields" in node]
    assert kept == [], f"status fields kept without a schema: {kept}"
    plan = status["properties"]["plan"]
    assert set(plan["properties"]) == set(Plan.model_fields) and plan["properties"]["feasible"]["type"] == "boolean"
    assert plan["properties"]["categories"]["items"]["properties"]["placement"]["items"]["required"] == [
        "stratum", "bytes"]
    with pytest.raises(ValidationError, match="bogus"):
        FineTuneJobStatus.model_validate({"phase": "Running", "bogus": 1})
    with pytest.raises(ValidationError, match="plan.feasible"):
        FineTuneJobStatus.model_validate({"plan": {"parameters": 1, "engine": "memstrata", "feasible": "maybe",
                                                   "categories": [], "strata": []}})


def test_crd_yaml_round_trips() -> None:
    assert yaml.safe_load(crd_yaml()) == generate_crd()


def _spec_schema():
    return generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_volumes_are_kubernetes_volumes_kept_whole_and_keyed_by_name() -> None:
    volumes = _spec_schema()["properties"]["volumes"]
    item = volumes["items"]
    # Any volume source passes through (the API server checks it on the pod): unknown fields are kept, not pruned.
    assert item["x-kubernetes-preserve-unknown-fields"] is True and item["required"] == ["name"]
    assert (volumes["x-kubernetes-list-type"], volumes["x-kubernetes-list-map-keys"]) == ("map", ["name"])
    assert volumes["maxItems"] == 64
    assert item["x-kubernetes-validations"][0]["rule"] == "self.name != 'runtime-config'"
    mounts = _spec_schema()["properties"]["volumeMounts"]
    assert (mounts["x-kubernetes-list-type"], mounts["x-kubernetes-list-map-keys"]) == ("map", ["mountPath"])
    assert "'/etc/memstrata/'" in mounts["items"]["x-kubernetes-validations"][0]["rule"]


def test_cel_rules_follow_the_optional_architecture_and_the_volumes() -> None:
    spec = _spec_schema()
    model_rules = [r["rule"] for r in spec["properties"]["model"]["x-kubernetes-validations"]]
    assert not any("has(self.architecture)" in r and "has(self.path)" in r for r in model_rules), model_rules
    assert spec["properties"]["model"].get("required") is None
    rules = {r["message"]: r["rule"] for r in spec["x-kubernetes-validations"]}
    mounts_rule = rules["every volumeMounts[].name must be one of spec.volumes[].name"]
    assert "self.volumes.exists(v, v.name == m.name)" in mounts_rule
    immutable = next(r for m, r in rules.items() if "immutable" in m)
    for field in ("output", "checkpoint", "volumes", "volumeMounts"):
        assert f"self.{field} == oldSelf.{field}" in immutable
    dataset_rules = [r["message"] for r in spec["properties"]["dataset"]["x-kubernetes-validations"]]
    assert "set at most one of dataset.validationSplit or dataset.validationPath" in dataset_rules


def test_status_carries_the_learned_shape_and_the_output() -> None:
    status = generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["properties"]["modelArchitecture"]["required"][:2] == ["layers", "hidden"]
    assert status["properties"]["output"]["required"] == ["path", "step", "files", "bytes"]
    assert "Inspected" in status["properties"]["conditions"]["items"]["properties"]["type"]["enum"]
