"""A pydantic validation error as one line that names the field, the way every memstrata refusal reads."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

__all__ = ["describe_validation_error", "field_path"]


def field_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<document>"


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """`spec.training.steps: Input should be greater than 0 (got -5)`, plus how many more."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    path = field_path(((prefix,) if prefix else ()) + loc)
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown field"
    elif first["type"] != "missing" and "input" in first and not isinstance(first["input"], (dict, list)):
        msg += f" (got {first['input']!r})"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{path}: {msg}{more}"
