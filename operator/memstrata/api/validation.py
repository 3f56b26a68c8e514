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


SHOWN = 5  # problems named in full; past them, a count (a message stays one readable line)


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """`spec.training.steps: Input should be greater than 0 (got -5)`: every problem, each naming its field,
    joined by '; ' (an unknown field, usually a misspelt one, first), the ones past SHOWN counted."""
    errors = sorted(exc.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    lines = [_one(e, prefix) for e in errors[:SHOWN]]
    more = len(errors) - SHOWN
    if more > 0:
        lines.append(f"and {more} more problem{'s' if more > 1 else ''}")
    return "; ".join(lines)


def _one(error: Any, prefix: str) -> str:
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    path = field_path(((prefix,) if prefix else ()) + loc)
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        msg = "unknown field"
    elif error["type"] != "missing" and "input" in error and not isinstance(error["input"], (dict, list)):
        msg += f" (got {error['input']!r})"
    return f"{path}: {msg}"
