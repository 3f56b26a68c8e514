"""Kubernetes quantities ("512Gi", "3.84T", "1e3", "500m", 1073741824) and byte sizes as we print them.

One parser, `parse_quantity`, reads the quantity grammar of Kubernetes'
resource.Quantity exactly (no floats):

    [+|-] digits[.digits] | .digits   then one optional suffix:
    binary   Ki Mi Gi Ti Pi Ei         (2**10 ... 2**60)
    decimal  n u m "" k M G T P E      (10**-9 ... 10**18; "m" is milli, "M" mega)
    exponent e<int> or E<int>          ("1e3" is 1000; a bare "E" is exa)

Two readings of it, for the two places quantities appear:

- `parse_bytes` — byte counts a user writes (FineTuneJob memory fields, the
  inventory): never negative, and no sub-unit suffix (n, u, m): "512m" bytes is
  a half-kilobyte typo for 512Mi far more often than a wish for 0.512 bytes,
  so it is refused with a hint rather than rounded to 1 byte. A fraction left
  by a decimal point or exponent ("1.5", "1e-1") rounds up to a whole byte.
- `quantity_value` — what the API server hands the operator (Node allocatable,
  pod requests of extended resources): Kubernetes' own `Quantity.Value()`,
  rounded up to an integer. Extended resources must be integers (the API
  server refuses "500m" for them), so millis only ever round something
  already whole; they are accepted because Value() accepts them.

`QUANTITY_PATTERN` is `parse_bytes`' string grammar for the CRD's CEL rule, so
the API server refuses exactly what the runtime would.
"""
from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

GiB = 1 << 30
_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_SUB_UNIT = ("n", "u", "m")
# Binary before exponent before decimal: "1Ei" is exbi, "1E3" a thousand, "1E" exa.
_QUANTITY = re.compile(r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:([KMGTPE]i)|[eE]([+-]?[0-9]+)|([numkMGTPE]))?")
_GRAMMAR = "a number with an optional suffix: Ki Mi Gi Ti Pi Ei, k M G T P E, m, or an exponent like 1e3"


def parse_quantity(value: str | int) -> Fraction:
    """The exact value of a Kubernetes quantity; raise ValueError naming the value."""
    if isinstance(value, bool):
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    if isinstance(value, int):
        return Fraction(value)
    m = _QUANTITY.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"not a Kubernetes quantity: {value!r} (expected {_GRAMMAR})")
    sign, number, binary, exponent, decimal = m.groups()
    scale = Fraction(_BINARY[binary]) if binary else Fraction(10) ** int(exponent or _DECIMAL[decimal or ""])
    magnitude = Fraction(Decimal(number)) * scale
    return -magnitude if sign == "-" else magnitude


def _suffix(text: str) -> str:
    m = _QUANTITY.fullmatch(text)
    return (m.group(5) or "") if m else ""


def quantity_value(value: str | int) -> int:
    """A Kubernetes quantity as `Quantity.Value()` gives it: rounded up to an integer. Never negative here:
    allocatable and requests cannot be."""
    exact = parse_quantity(value)
    if exact < 0:
        raise ValueError(f"quantity must not be negative, got {value!r}")
    return math.ceil(exact)


def parse_bytes(value: object) -> int:
    """A byte count: an integer, an integral float, or a quantity string; raise ValueError naming the value."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte quantity, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte quantity must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a byte quantity like 512Gi or 3.84T, got {value!r}")
    try:
        exact = parse_quantity(value)
    except ValueError:
        raise ValueError(f"expected a byte quantity like 512Gi or 3.84T, got {value!r}") from None
    if _suffix(value) in _SUB_UNIT:
        raise ValueError(f"{value!r} is a fraction of a byte: '{_suffix(value)}' is a sub-unit "
                         f"(m = 1/1000); for mebibytes write Mi, for megabytes M")
    if exact < 0:
        raise ValueError(f"byte quantity must not be negative, got {value!r}")
    return math.ceil(exact)


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: 1.5 GiB, 312.0 MiB, 0 B."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# parse_bytes' string grammar. [.] and [+] rather than \. and \+ : CEL string literals reject those escapes.
QUANTITY_PATTERN = r"^[+]?([0-9]+([.][0-9]*)?|[.][0-9]+)([KMGTPE]i|[eE][+-]?[0-9]+|[kMGTPE])?$"
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
            "message": "must be a non-negative byte count or a quantity like 512Gi, 3.84T or 1e9",
        }],
    }),
]
