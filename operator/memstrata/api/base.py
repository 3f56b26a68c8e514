"""The base of every memstrata contract model.

Kubernetes objects are camelCase on the wire and snake_case in Python; unknown
fields are errors, because a misspelt `gradientAccumulaton` silently ignored
is a job that trains with the wrong settings.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonDict


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )

    def wire(self) -> dict[str, Any]:
        """The object as it appears in YAML/JSON: camelCase, unset defaults omitted."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def cel(rule: str, message: str, field_path: str | None = None) -> JsonDict:
    """A CEL rule for a model's `x-kubernetes-validations` (the API server's copy of a cross-field validator)."""
    out: JsonDict = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out
