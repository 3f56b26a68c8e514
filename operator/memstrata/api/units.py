"""Byte quantities as users write them ("512Gi", "3.84T", 1073741824) and as we print them."""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

GiB = 1 << 30
_SUFFIX = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
}
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kMGTP]i?)?\s*$")


def parse_bytes(value: object) -> int:
    """Parse a Kubernetes-style quantity of bytes; raise ValueError naming the value."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte quantity, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte quantity must not be negative, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _QUANTITY.match(value)
        if m:
            return int(float(m.group(1)) * _SUFFIX[m.group(2) or ""])
    raise ValueError(f"expected a byte quantity like 512Gi or 3.84T, got {value!r}")


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: 1.5 GiB, 312.0 MiB, 0 B."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# [.] rather than \. : CEL string literals reject that escape.
QUANTITY_PATTERN = r"^[0-9]+([.][0-9]+)?([kMGTP]i?)?$"
Bytes = Annotated[
    int,
    BeforeValidator(parse_bytes),
    PlainSerializer(lambda v: v, return_type=int),
    # On the wire a byte count is an integer or a quantity string, like Kubernetes' own. A structural
    # schema allows only bare types under int-or-string's anyOf, so the bounds are a CEL rule.
    WithJsonSchema({
        "x-kubernetes-int-or-string": True,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-validations": [{
            "rule": f"type(self) == int ? self >= 0 : self.matches('{QUANTITY_PATTERN}')",
            "message": "must be a non-negative byte count or a quantity like 512Gi or 3.84T",
        }],
    }),
]
