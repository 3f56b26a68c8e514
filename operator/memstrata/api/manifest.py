"""Reading user files (job manifests, node files) into contract models.

Every failure becomes a ManifestError with one line that names the file and the
field, because that line is all a user sees before exit status 2.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from memstrata.api.validation import describe_validation_error

if TYPE_CHECKING:
    from memstrata.api.finetunejob import FineTuneJob
    from memstrata.api.inventory import NodeInventory

M = TypeVar("M", bound=BaseModel)


class ManifestError(ValueError):
    """A user-supplied file is unreadable or invalid; the message is one line."""


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ManifestError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise ManifestError(f"{p}: is a directory, expected a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{p}: cannot read: {exc}") from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ManifestError(f"{p}: malformed YAML{where}: {problem}") from None
    if not docs:
        raise ManifestError(f"{p}: empty file")
    if len(docs) > 1:
        raise ManifestError(f"{p}: holds {len(docs)} YAML documents; expected one")
    doc = docs[0]
    if not isinstance(doc, dict):
        raise ManifestError(f"{p}: expected a mapping at the top level, got a {type(doc).__name__}")
    return doc


def parse_model(model: type[M], data: Any, source: str) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(f"{source}: {describe_validation_error(exc)}") from None


def load_job(path: str | Path) -> "FineTuneJob":
    from memstrata.api.finetunejob import API_VERSION, KIND, FineTuneJob

    doc = load_yaml_mapping(path)
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if kind != KIND:
        raise ManifestError(f"{path}: kind: expected {KIND}, got {kind!r}")
    if api_version != API_VERSION:
        raise ManifestError(f"{path}: apiVersion: expected {API_VERSION}, got {api_version!r}")
    return parse_model(FineTuneJob, doc, str(path))


def load_node(path: str | Path) -> "NodeInventory":
    """A node file: either a NodeInventory (kind: NodeInventory) or a Kubernetes Node object."""
    from memstrata.api.inventory import NodeInventory, NodeNotManagedError, read_node

    doc = load_yaml_mapping(path)
    kind = doc.pop("kind", "NodeInventory")
    doc.pop("apiVersion", None)
    if kind == "Node":
        try:
            return read_node(doc)
        except NodeNotManagedError as exc:
            raise ManifestError(f"{path}: {exc}") from None
    if kind != "NodeInventory":
        raise ManifestError(f"{path}: kind: expected NodeInventory or Node, got {kind!r}")
    return parse_model(NodeInventory, doc, str(path))

